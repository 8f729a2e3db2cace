"""FL: Flower's message-based FedAvg over the LoRA adapters, with the wire in the loop.

Only what FedAvg cannot do is overridden: adapters travel through the wire (dtype
policy, byte ledger, observers — iDLG-style attacks see exactly the updates the
server received), a reply that is an error, arrives late or fails the wire's checks
is reported and left out while the rest are averaged, and each round ends in the
run's callbacks. Rounds are numbered from the checkpoint a run resumed from.

The wire sits between the strategy and the grid (`WireGrid`), as `clients.app`'s
`fl_wire_mod` sits between the ClientApp and its handlers: the strategy composes and
averages fp32 numpy arrays, as Flower's strategies and their wrappers expect, and the
grid encodes what it sends and decodes and screens what comes back. So a wrapper
strategy (Flower's DP wrappers, strategies.dp) and a client mod see the adapters, never the
wire's bytes. Under SecAgg+ (strategies.secagg) the grid runs a training round as Flower's
protocol and hands the strategy the survivors' unmasked average as the round's one reply.

Flower samples and orders by its random node ids; here the clients of a round are
drawn from the partitions with the run's seed and averaged in partition order, so the
same config gives the same weights under any runtime and after a resume.
"""

import random
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from pruning import PruningRecord
from config import SimConfig
from config.schema import POISSON
from strategies.base import ClientFault, GridWrapper, Outcomes, pruning_record, sample_level_budget
from strategies.callbacks import RunCallback
from strategies.canary_audit import CanaryAudit
from strategies.dp import FederatedDP
from strategies.secagg import SECAGG_ROUND_TRIPS, SecureAggregation, SecureRound
from training import protocol
from vlm.profiles import get_profile
from wire import Transfer, Wire, WireError, numpy_record, numpy_tensors, serialized_size


def scalar_metrics_average(contents: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Flower's weighted average of the evaluation replies' metrics but their per-question lists
    (training.protocol.QUESTIONS), which differ in length between clients: `aggregate_evaluate`
    gathers those whole."""

    def scalars(record: MetricRecord) -> MetricRecord:
        return MetricRecord({key: value for key, value in record.items() if not isinstance(value, list)})

    return aggregate_metricrecords(
        [RecordDict({name: scalars(record) for name, record in content.metric_records.items()}) for content in contents],
        weighted_by_key,
    )


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
            evaluate_metrics_aggr_fn=scalar_metrics_average,
        )
        self.config, self.wire, self.callbacks = config, wire, list(callbacks)
        # Node id -> partition id, in partition order (strategies.base.federation_partitions).
        self.partitions = dict(partitions)
        self.global_shapes = global_shapes
        self.offset = first_round - 1
        self.poisson = config.clients.sampling == POISSON
        # The global adapters the round's clients start from (poisson: its sum is taken against them).
        self.round_start: ArrayRecord | None = None
        self.num_rounds = num_rounds
        self.arrays: ArrayRecord | None = None
        self.record: dict[str, Any] = {}
        self.num_patches = get_profile(config.model.profile).num_patches
        self.pruned = PruningRecord(num_patches=self.num_patches)
        self.faults: list[dict[str, Any]] = []
        self.sent_to: list[int] = []
        # The round and phase ("train", "evaluate") of the messages the grid carries now.
        self.current: tuple[int, str] = (first_round, "train")
        self.started = time.perf_counter()
        # The auditor's canary clients (threat.update_canaries) join the average inside the DP wrapper.
        self.audited: Strategy = self
        if config.threat.update_canaries:
            self.audited = CanaryAudit(config, self, global_shapes, config.run_folder(), first_round - 1)
        # DP-FedAvg (privacy.dp): Flower's wrapper around this strategy, and the budget it spends.
        self.dp = FederatedDP(config, self.audited) if config.privacy.dp.federated else None
        # SecAgg+ (privacy.secagg): training rounds whose updates the server only sees summed.
        self.secagg = SecureAggregation(config) if config.privacy.secagg.enabled else None
        self.sent_bytes: dict[int, int] = {}
        # message id -> node of the messages last sent (WireGrid), to place Flower's own error replies.
        self.sent_ids: dict[str, int] = {}
        self.secured = 0
        # DP-SGD: what each accepted reply reported of its client's budget this round.
        self.client_budgets: list[dict[str, Any]] = []

    @property
    def outer(self) -> Strategy:
        """The strategy to start: this one, or the wrappers around it (canaries, then DP)."""
        return self.dp.outer if self.dp else self.audited

    def round_of(self, server_round: int) -> int:
        return server_round + self.offset

    def sampled_nodes(self, round_: int) -> list[int]:
        """The round's trainers, drawn from the run's seed and the round, in partition order:
        `fraction_train` of the partitions (at least one), or under poisson sampling each
        partition by its own coin of that probability."""
        nodes = list(self.partitions)
        draw = random.Random(f"fl-sample:{self.config.model.seed}:{round_}")
        if self.poisson:
            return [node for node in nodes if draw.random() < self.fraction_train]
        chosen = draw.sample(range(len(nodes)), max(1, int(len(nodes) * self.fraction_train)))
        return [nodes[i] for i in sorted(chosen)]

    def denominator(self, kept: int) -> int:
        """What a round's sum of updates is divided by: the clients averaged, or under poisson
        sampling the expected cohort, whoever came (DP-FedAvg's fixed denominator)."""
        return self.config.clients.sampled if self.poisson else kept

    def _compose(self, arrays: ArrayRecord, config: ConfigRecord, nodes: list[int], message_type: str,
                 round_: int, phase: str) -> list[Message]:
        """One message per node with the adapters (fp32; the grid encodes them) and the round,
        beside what a wrapper put in `config` (a DP wrapper's clipping norm)."""
        self.sent_to, self.current = list(nodes), (round_, phase)
        content = RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: ConfigRecord({**config, "round": round_})})
        return [Message(content=content, message_type=message_type, dst_node_id=node) for node in nodes]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.started = time.perf_counter()
        self.record, self.faults, self.client_budgets = {}, [], []
        self.pruned = PruningRecord(num_patches=self.num_patches)
        self.round_start = arrays
        round_ = self.round_of(server_round)
        return self._compose(arrays, config, self.sampled_nodes(round_), protocol.TRAIN, round_, "train")

    # -- the wire, applied by WireGrid --------------------------------------------------------
    def wire_out(self, messages: list[Message]) -> list[Message]:
        """The messages with their adapters encoded under the wire's dtype policy, counted and
        shown to the observers of what the server sends."""
        round_, _ = self.current
        out, encoded = [], {}
        for message in messages:
            kind = protocol.CARRIES[message.metadata.message_type]
            arrays = message.content.array_records[protocol.ARRAYS]
            # The round's messages share one ArrayRecord: encoded once.
            if id(arrays) not in encoded:
                encoded[id(arrays)] = self.wire.encode(numpy_tensors(arrays))
            content = RecordDict({**message.content.config_records, protocol.ARRAYS: encoded[id(arrays)]})
            node = message.metadata.dst_node_id
            self.sent_bytes[node] = self.wire.sent(
                round_, node, content, kind=kind.name if kind.replayed else None, record_key=protocol.ARRAYS
            )
            out.append(Message(content=content, message_type=message.metadata.message_type, dst_node_id=node))
        return out

    def wire_in(self, replies: Iterable[Message]) -> list[Message]:
        """The replies that may be folded in, decoded (training) or counted (evaluation)."""
        round_, phase = self.current
        if phase == "train":
            return self._screen(replies, round_, phase, decode=True)
        kept = self._screen(replies, round_, phase, decode=False)
        for reply in kept:
            self.wire.ledger.add(round_, reply.metadata.src_node_id, "up", serialized_size(reply.content))
        return kept

    def secure_in(self, result: SecureRound, sent: list[Message]) -> list[Message]:
        """A SecAgg+ round as the one reply FedAvg averages: the survivors' weighted average,
        weighted by their summed example counts. The observers see each survivor's masked vector
        as its update (all the server received of it); the clients that dropped out are reported."""
        round_, _ = self.current
        for node in self.sent_to:
            down, up = result.traffic.get(node, (0, 0))
            # Stage 2 carried the adapters wire_out already counted.
            self.wire.ledger.add(round_, node, "down", down - self.sent_bytes.get(node, 0))
            self.wire.ledger.add(round_, node, "up", up)
            if node not in result.metrics:
                why = f" ({'; '.join(result.failures)})" if result.failures else ""
                self._fault(node, "train", f"dropped out of the SecAgg+ round{why}; its masks were removed from the sum")
        if result.average is None:
            return []
        names = list(self.global_shapes)
        survivors = sorted(result.metrics, key=lambda node: self.partitions[node])
        for node in survivors:
            masked = {name: torch.from_numpy(array).float() for name, array in zip(names, result.masked[node], strict=True)}
            self.wire.show(Transfer(round_, node, protocol.ADAPTER_UPDATE.name, masked, result.traffic[node][1]))
            self.pruned = self.pruned.merge(pruning_record(RecordDict({protocol.METRICS: MetricRecord(result.metrics[node])})))
            self.client_budgets.append(result.metrics[node])
        average = {name: torch.from_numpy(array).float() for name, array in zip(names, result.average, strict=True)}
        examples = sum(result.metrics[node]["num-examples"] for node in survivors)
        loss = sum(result.metrics[node]["loss"] * result.metrics[node]["num-examples"] for node in survivors) / examples
        self.secured = len(survivors)
        content = RecordDict({protocol.ARRAYS: numpy_record(average),
                              protocol.METRICS: MetricRecord({"num-examples": examples, "loss": loss})})
        return [Message(content=content, reply_to=sent[0])]

    def _screen(self, replies: Iterable[Message], round_: int, phase: str, decode: bool) -> list[Message]:
        """Replies that may be folded in, in partition order (the average's summation order);
        the rest are reported with their reason."""
        by_node = sorted(((self._answering(reply), reply) for reply in replies),
                         key=lambda pair: self.partitions.get(pair[0], len(self.partitions)))
        answered = {node for node, _ in by_node}
        for node in self.sent_to:
            if node not in answered:
                self._fault(node, phase, f"no reply within faults.timeout_s={self.config.faults.timeout_s}s")
        kept = []
        for node, reply in by_node:
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
            self.client_budgets.append(dict(reported))
            # FedAvg averages numpy arrays: the accepted update, decoded to fp32.
            content = RecordDict({protocol.ARRAYS: numpy_record(tensors), protocol.METRICS: metrics})
            kept.append(Message(content=content, reply_to=reply))
        return kept

    def _answering(self, reply: Message) -> int:
        """The node a reply answers for. An error reply that Flower's SuperLink makes itself (a
        node gone, a message expired) comes from the SuperLink's own id: the message it answers
        names the node."""
        node = reply.metadata.src_node_id
        if node in self.partitions:
            return node
        return self.sent_ids.get(reply.metadata.reply_to_message_id, node)

    def _fault(self, node: int, phase: str, reason: str) -> None:
        consequence = "left out of this round's average" if phase == "train" else "not scored this round"
        self.faults.append({"client": node, "phase": phase, "reason": reason[-2000:], "consequence": consequence})

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """FedAvg over the replies the grid accepted (WireGrid: decoded and screened)."""
        round_ = self.round_of(server_round)
        kept = list(replies)
        if not kept:
            raise RuntimeError(f"no client update could be averaged in round {round_}: {self.faults}")
        arrays, metrics = super().aggregate_train(server_round, kept)
        if self.poisson:
            arrays = self._fixed_denominator_average(kept)
        # Under SecAgg+ one reply stands for the survivors' sum.
        averaged = self.secured if self.secagg else len(kept)
        self.record.update({"train_loss": float(metrics["loss"]), "steps": self.config.train.steps_per_round,
                            "clients_averaged": averaged, **self.pruned.as_round_metrics()})
        if self.dp:
            self.record.update(self.dp.release(averaged, len(self.sent_to)))
        self.record.update(sample_level_budget(self.client_budgets))
        return arrays, metrics

    def _fixed_denominator_average(self, replies: list[Message]) -> ArrayRecord:
        """The round's start plus the sum of its updates over the expected cohort."""
        start = numpy_tensors(self.round_start)
        total = {name: torch.zeros_like(value) for name, value in start.items()}
        for reply in replies:
            for name, value in numpy_tensors(reply.content.array_records[protocol.ARRAYS]).items():
                total[name] += value - start[name]
        cohort = self.denominator(len(replies))
        return numpy_record({name: start[name] + total[name] / cohort for name in start})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        # The global model the loop goes on with (after any wrapper's noise): what the round's
        # checkpoint keeps.
        self.arrays = arrays
        round_ = self.round_of(server_round)
        every = self.config.eval.every
        if every == 0 or (round_ % every and round_ != self.num_rounds):
            self.sent_to, self.current = [], (round_, "evaluate")
            return []
        return self._compose(arrays, config, list(self.partitions), protocol.FL_EVALUATE, round_, "evaluate")

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        round_ = self.round_of(server_round)
        kept = list(replies)
        correct = sum(r.content.metric_records[protocol.METRICS]["correct"] for r in kept)
        count = sum(r.content.metric_records[protocol.METRICS]["count"] for r in kept)
        if self.sent_to:
            outcomes = Outcomes()
            for reply in kept:
                outcomes.add(reply.content.metric_records[protocol.METRICS])
            self.record.update({"test_accuracy": correct / count if count else None, "test_count": count,
                                **outcomes.record()})
        self.record.update(self.wire.ledger.round_totals(round_))
        trips = SECAGG_ROUND_TRIPS if self.secagg else 1
        self.record.update({
            "bytes_per_client": self.wire.ledger.per_client(round_),
            "round_trips_train": trips, "round_trips_eval": 1 if self.sent_to else 0,
            "round_trips_per_step": trips / self.config.train.steps_per_round,
            "faults": self.faults, "wall_s": time.perf_counter() - self.started,
        })
        state = {"arrays": numpy_tensors(self.arrays)}
        if self.dp:
            state["dp"] = self.dp.state_dict()
        for callback in self.callbacks:
            callback.on_round_end(round_, dict(self.record), state)
        return super().aggregate_evaluate(server_round, kept) if kept else None


class WireGrid(GridWrapper):
    """The run's grid with FL's wire between it and the strategy (WireFedAvg.wire_out /
    wire_in): the strategy, and any strategy wrapping it, sends and receives fp32 adapters."""

    def __init__(self, grid: Grid, strategy: WireFedAvg) -> None:
        super().__init__(grid)
        self.strategy = strategy

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        sent = self.strategy.wire_out(list(messages))
        if not sent:
            return []
        round_, phase = self.strategy.current
        if self.strategy.secagg and phase == "train":
            replies = self.strategy.secure_in(self.strategy.secagg.round(self.grid, sent, round_), sent)
        else:
            received = self.grid.send_and_receive(sent, timeout=timeout)
            # The grid gave each message its id as it pushed it: what a reply names as its question.
            self.strategy.sent_ids = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
            replies = self.strategy.wire_in(received)
        if phase == "train" and self.strategy.dp:
            # Aggregation comes next, and with it the DP wrapper's noise.
            self.strategy.dp.before_aggregation(round_)
        return replies
