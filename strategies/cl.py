"""CL: one trainer holds all data (the accuracy reference); nothing crosses a wire.

The server only paces rounds: the trainer keeps its adapters and AdamW in its own
store, and scores its test set itself.
"""

from typing import Any

from flwr.serverapp import Grid

from strategies.base import Outcomes, RoundStrategy, pruning_record, sample_level_budget
from training import protocol


class CLStrategy(RoundStrategy):
    def train_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        # `nodes` holds the node of the lowest partition (strategies.base.federation_partitions).
        reply = self.exchange(grid, nodes[0], round_, protocol.CL_TRAIN, {"committed-round": round_ - 1})
        self.receive(round_, nodes[0], protocol.TRAINING_REPORT, reply)  # counted: metrics only
        metrics = reply.metric_records[protocol.METRICS]
        return {
            "train_loss": metrics["loss"],
            "steps": self.config.train.steps_per_round,
            **pruning_record(reply).as_round_metrics(),
            **sample_level_budget([dict(metrics)]),
        }

    def evaluate_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        reply = self.exchange(grid, nodes[0], round_, protocol.LOCAL_EVALUATE, {})
        self.receive(round_, nodes[0], protocol.EVALUATION_SCORE, reply)
        metrics = reply.metric_records[protocol.METRICS]
        outcomes = Outcomes()
        outcomes.add(metrics)
        return {"test_accuracy": metrics["correct"] / max(metrics["count"], 1.0), "test_count": metrics["count"],
                **outcomes.record()}
