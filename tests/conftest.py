"""Shared fixtures: single-threaded torch, Flower's task identity, and an in-process Grid.

FakeGrid hands each message straight to a ClientApp, the way a SuperNode would but
in this process, and turns a handler's exception into the error reply Flower sends
(code 2, traceback as reason). Strategy and client logic are then tested through
real Messages without the ~10 s start-up of `flwr run`.
"""

import traceback
from collections.abc import Callable, Iterable

import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def single_thread_torch():
    """Tiny tensors gain nothing from intra-op threads on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def task_identity():
    """Messages read the run and task ids of the process that builds them."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class FakeGrid:
    def __init__(self, client_app: ClientApp, run_config: dict, num_nodes: int) -> None:
        self.client_app = client_app
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": node - 1, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for node in range(1, num_nodes + 1)
        }
        # node -> function(message) that may raise or return a replacement reply.
        self.interceptors: dict[int, Callable[[Message, Message], Message | None]] = {}
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            node = message.metadata.dst_node_id
            try:
                reply = self.client_app(message, self.contexts[node])
                if node in self.interceptors:
                    reply = self.interceptors[node](message, reply)
            except Exception:  # noqa: BLE001 - the runtime turns any handler failure into an error reply
                reply = Message(Error(code=2, reason=traceback.format_exc()), reply_to=message)
            if reply is not None:
                replies.append(reply)
        return replies


@pytest.fixture
def fake_grid():
    return FakeGrid


def tiny_run_config(tmp_path, **overrides) -> dict:
    """A run config for the tiny profile on a few easy-VQA rows; overrides use dotted keys."""
    config = {
        "paradigm": "usl",
        "model.profile": "tiny",
        "data.dataset": "easyvqa",
        "data.train_limit": 24,
        "data.test_limit": 6,
        "clients.count": 2,
        "train.rounds": 1,
        "train.steps_per_round": 1,
        "train.batch_size": 4,
        "train.lr": 1e-2,
        "eval.every": 0,
        "eval.batch_size": 4,
        "eval.max_new_tokens": 2,
        "faults.timeout_s": 30.0,
        "output.root": str(tmp_path),
        "output.name": "run",
    }
    config.update(overrides)
    return config


@pytest.fixture
def run_config(tmp_path):
    return lambda **overrides: tiny_run_config(tmp_path, **overrides)
