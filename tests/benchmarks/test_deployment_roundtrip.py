"""The deployment round-trip benchmark's floor answers what the round-trip server asks, as the
system's own ClientApp does (it cannot import training.protocol: that would bring torch)."""

import sys
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from training import protocol

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "roundtrip_app"))

import floor_client  # noqa: E402


def test_the_floor_answers_the_partition_query_as_the_system_does(monkeypatch):
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 5)):
        monkeypatch.setattr(TaskIdentity, name, value)
    query = Message(content=RecordDict(), message_type=protocol.PARTITION_QUERY, dst_node_id=5)
    query.metadata.__dict__["_message_id"] = query.object_id
    context = Context(run_id=1, node_id=5, node_config={protocol.PARTITION_ID: 1}, state=RecordDict(), run_config={})
    reply = floor_client.app(query, context)
    assert reply.content[protocol.METRICS][protocol.PARTITION_ID] == 1
