"""FL: Flower's message-based FedAvg over the LoRA adapters, with the wire in the loop.

Only what FedAvg cannot do is overridden: adapters travel through the wire (dtype
policy, byte ledger, observers — iDLG-style attacks see exactly the updates the
server received), a reply that is an error, arrives late or fails the wire's checks
is reported and left out while the rest are averaged, and each round ends in the
run's callbacks. Rounds are numbered from the checkpoint a run resumed from.

Flower samples and orders by its random node ids; here the clients of a round are
drawn from the partitions with the run's seed and averaged in partition order, so the
same config gives the same weights under any runtime and after a resume.
"""

import random
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from pruning import PruningRecord
from config import SimConfig
from strategies.base import ClientFault, pruning_record
from strategies.callbacks import RunCallback
from training import protocol
from vlm.profiles import get_profile
from wire import Wire, WireError, serialized_size


def to_numpy_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().float().cpu().numpy()) for k, v in tensors.items()})


class WireFedAvg(FedAvg):
    def __init__(
        self,
        config: SimConfig,
        wire: Wire,
        global_shapes: dict[str, tuple[int, ...]],
        partitions: Mapping[int, int],
        callbacks: Sequence[RunCallback] = (),
        first_round: int = 1,
        num_rounds: int = 1,
    ) -> None:
        super().__init__(
            fraction_train=config.clients.fraction_train,
            fraction_evaluate=1.0,
            arrayrecord_key=protocol.ARRAYS,
            configrecord_key=protocol.CONFIG,
        )
        self.config, self.wire, self.callbacks = config, wire, list(callbacks)
        # Node id -> partition id, in partition order (strategies.base.federation_partitions).
        self.partitions = dict(partitions)
        self.global_shapes = global_shapes
        self.offset = first_round - 1
        self.num_rounds = num_rounds
        self.arrays: ArrayRecord | None = None
        self.record: dict[str, Any] = {}
        self.num_patches = get_profile(config.model.profile).num_patches
        self.pruned = PruningRecord(num_patches=self.num_patches)
        self.faults: list[dict[str, Any]] = []
        self.sent_to: list[int] = []
        self.started = time.perf_counter()

    def round_of(self, server_round: int) -> int:
        return server_round + self.offset

    def sampled_nodes(self, round_: int) -> list[int]:
        """The round's trainers: `fraction_train` of the partitions (at least one), drawn from
        the run's seed and the round, in partition order."""
        nodes = list(self.partitions)
        size = max(1, int(len(nodes) * self.fraction_train))
        chosen = random.Random(f"fl-sample:{self.config.model.seed}:{round_}").sample(range(len(nodes)), size)
        return [nodes[i] for i in sorted(chosen)]

    def _send(self, arrays: ArrayRecord, nodes: list[int], message_type: str, round_: int) -> list[Message]:
        """One message per node with the adapters encoded under the wire's dtype policy."""
        kind = protocol.CARRIES[message_type]
        tensors = {k: torch.from_numpy(a.numpy()) for k, a in arrays.items()}
        content = RecordDict({protocol.ARRAYS: self.wire.encode(tensors), protocol.CONFIG: ConfigRecord({"round": round_})})
        for node in nodes:
            self.wire.sent(round_, node, content, kind=kind.name if kind.replayed else None, record_key=protocol.ARRAYS)
        self.sent_to = list(nodes)
        return [Message(content=content, message_type=message_type, dst_node_id=node) for node in nodes]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.started = time.perf_counter()
        self.record, self.faults = {}, []
        self.pruned = PruningRecord(num_patches=self.num_patches)
        round_ = self.round_of(server_round)
        return self._send(arrays, self.sampled_nodes(round_), protocol.FL_TRAIN, round_)

    def _screen(self, replies: Iterable[Message], round_: int, phase: str, decode: bool) -> list[Message]:
        """Replies that may be folded in, in partition order (the average's summation order);
        the rest are reported with their reason."""
        replies = sorted(replies, key=lambda reply: self.partitions[reply.metadata.src_node_id])
        answered = {reply.metadata.src_node_id for reply in replies}
        for node in self.sent_to:
            if node not in answered:
                self._fault(node, phase, f"no reply within faults.timeout_s={self.config.faults.timeout_s}s")
        kept = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self._fault(node, phase, reply.error.reason.strip())
                continue
            if not decode:
                kept.append(reply)
                continue
            expected = protocol.ADAPTER_UPDATE.expectation(adapter_shapes=self.global_shapes)
            try:
                tensors = self.wire.received(
                    round_, node, protocol.ADAPTER_UPDATE.name, reply.content, expected, record_key=protocol.ARRAYS
                )
                reported = reply.content.metric_records[protocol.METRICS]
                metrics = MetricRecord({key: reported[key] for key in ("num-examples", "loss")})
                pruned = pruning_record(reply.content)
            except (WireError, KeyError, ClientFault) as error:
                self._fault(node, phase, f"{type(error).__name__}: {error}")
                continue
            self.pruned = self.pruned.merge(pruned)
            # FedAvg averages numpy arrays: the accepted update, decoded to fp32.
            content = RecordDict({protocol.ARRAYS: to_numpy_record(tensors), protocol.METRICS: metrics})
            kept.append(Message(content=content, reply_to=reply))
        return kept

    def _fault(self, node: int, phase: str, reason: str) -> None:
        consequence = "left out of this round's average" if phase == "train" else "not scored this round"
        self.faults.append({"client": node, "phase": phase, "reason": reason[-2000:], "consequence": consequence})

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        round_ = self.round_of(server_round)
        kept = self._screen(replies, round_, "train", decode=True)
        if not kept:
            raise RuntimeError(f"no client update could be averaged in round {round_}: {self.faults}")
        arrays, metrics = super().aggregate_train(server_round, kept)
        self.arrays = arrays
        self.record.update({"train_loss": float(metrics["loss"]), "steps": self.config.train.steps_per_round,
                            "clients_averaged": len(kept), **self.pruned.as_round_metrics()})
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        round_ = self.round_of(server_round)
        every = self.config.eval.every
        if every == 0 or (round_ % every and round_ != self.num_rounds):
            self.sent_to = []
            return []
        return self._send(arrays, list(self.partitions), protocol.FL_EVALUATE, round_)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        round_ = self.round_of(server_round)
        kept = self._screen(replies, round_, "evaluate", decode=False)
        for reply in kept:
            self.wire.ledger.add(round_, reply.metadata.src_node_id, "up", serialized_size(reply.content))
        correct = sum(r.content.metric_records[protocol.METRICS]["correct"] for r in kept)
        count = sum(r.content.metric_records[protocol.METRICS]["count"] for r in kept)
        if self.sent_to:
            self.record.update({"test_accuracy": correct / count if count else None, "test_count": count})
        self.record.update(self.wire.ledger.round_totals(round_))
        self.record.update({
            "bytes_per_client": self.wire.ledger.per_client(round_),
            "round_trips_train": 1, "round_trips_eval": 1 if self.sent_to else 0,
            "round_trips_per_step": 1 / self.config.train.steps_per_round,
            "faults": self.faults, "wall_s": time.perf_counter() - self.started,
        })
        state = {"arrays": {k: torch.from_numpy(a.numpy()) for k, a in self.arrays.items()}}
        for callback in self.callbacks:
            callback.on_round_end(round_, dict(self.record), state)
        return super().aggregate_evaluate(server_round, kept) if kept else None
