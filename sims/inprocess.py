"""Run a simulation in this one process, without Flower's runtime.

InProcessGrid hands each message straight to the ClientApp (as a SuperNode would, but
in this process) and turns a handler's exception into the error reply Flower sends
(code 2, traceback as reason). The strategies and client apps are the same objects
`flwr run` uses, so this isolates what Flower's runtime itself costs (benchmarks/)
and lets tests drive real Messages without the ~10 s start-up. Node i holds partition
i - 1 unless `node_ids` gives each partition's node id (as Flower's random ids would).
"""

import copy
import traceback
import uuid
from collections.abc import Iterable, Sequence

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from config import load_config
from strategies.callbacks import RunFolder
from training import protocol


class InProcessGrid:
    def __init__(
        self, client_app: ClientApp, run_config: dict, num_nodes: int, node_ids: Sequence[int] | None = None
    ) -> None:
        # Messages read the run and task ids of the process that builds them.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.client_app = client_app
        node_ids = list(node_ids) if node_ids is not None else list(range(1, num_nodes + 1))
        if len(node_ids) != num_nodes or len(set(node_ids)) != num_nodes:
            raise ValueError(f"node_ids={node_ids}: need {num_nodes} distinct ids, one per partition")
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={protocol.PARTITION_ID: partition, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for partition, node in enumerate(node_ids)
        }

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def deliver(self, message: Message) -> Message | None:
        """The node's reply to one message (None: no reply). The node gets its own copy, as over a
        real transport: a message's records may be shared by the messages of one send (Flower's
        SecAgg+ stages do) and a client mod may change what it received."""
        delivered = copy.copy(message)
        if message.has_content():
            delivered.content = RecordDict({name: type(record)(dict(record)) for name, record in message.content.items()})
        return self.client_app(delivered, self.contexts[message.metadata.dst_node_id])

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            if not message.metadata.message_id:
                # As Flower's grids do when they push a message: the id its reply names.
                message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            try:
                reply = self.deliver(message)
            except Exception:  # noqa: BLE001 - Flower's runtime turns any handler failure into an error reply
                reply = Message(Error(code=2, reason=traceback.format_exc()), reply_to=message)
            if reply is not None:
                replies.append(reply)
        return replies


def run_in_process(run_config: dict) -> RunFolder:
    """The run `run_config` describes, with clients.count in-process nodes."""
    from clients.app import app as client_app
    from strategies.app import run

    config = load_config(run_config)
    return run(InProcessGrid(client_app, run_config, config.clients.count), config)
