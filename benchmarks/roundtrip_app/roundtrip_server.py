"""A ServerApp that only times empty round trips: one partition query at a time to one node,
which clients.app answers from its node config; the first few absorb the node's start-up."""

import json
import time

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from config import load_config
from strategies.base import send_and_await
from training import protocol

WARMUP = 3
ROUND_TRIPS = 20

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    folder = load_config(context.run_config).run_folder()
    folder.mkdir(parents=True, exist_ok=True)
    while not (nodes := list(grid.get_node_ids())):
        time.sleep(0.1)
    seconds = []
    for _ in range(WARMUP + ROUND_TRIPS):
        query = Message(content=RecordDict(), message_type=protocol.PARTITION_QUERY, dst_node_id=nodes[0])
        started = time.perf_counter()
        # Awaited as the strategies await every reply.
        reply = send_and_await(grid, query, timeout=120)
        if reply is None or reply.has_error():
            raise RuntimeError(f"the node did not answer {protocol.PARTITION_QUERY}")
        seconds.append(time.perf_counter() - started)
    (folder / "status.json").write_text(json.dumps({"state": "finished", "round_trip_s": seconds[WARMUP:]}))
