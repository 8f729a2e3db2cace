"""Flower's floor: a ClientApp that imports only flwr and answers the round-trip server's
partition queries ("query.partition", training.protocol.PARTITION_QUERY, which cannot be
imported here without torch) from its node config. benchmarks/deployment_roundtrip.py runs
the round-trip app with this as its ClientApp beside the system's own."""

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query("partition")
def partition(message: Message, context: Context) -> Message:
    metrics = MetricRecord({"partition-id": int(context.node_config.get("partition-id", 0))})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=message)
