"""A small base for strategies that drive their own rounds (CL, SL, USL).

Subclasses implement `train_round` and `evaluate_round` (hooks) and say what their
server-side state is; the base runs rounds from a checkpoint, counts round trips,
times rounds, applies fault handling to every exchange, and hands each round's
record and state to the callbacks (metrics, checkpoints, status).
"""

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from pruning import PruningRecord
from config import SimConfig
from strategies.callbacks import OUTCOMES, RunCallback
from training import protocol
from wire import Wire, WireError

log = logging.getLogger(__name__)


class ClientFault(RuntimeError):
    """A client's reply is missing, is an error, or was rejected by the wire."""


class ServerFault(RuntimeError):
    """What the server itself would send is unusable (its segment diverged): the run stops, and
    no client is blamed for it."""


class RoundStrategy(ABC):
    def __init__(self, config: SimConfig, wire: Wire, callbacks: Sequence[RunCallback] = ()) -> None:
        self.config = config
        self.wire = wire
        self.callbacks = list(callbacks)
        self.round_trips: Counter[tuple[int, str]] = Counter()
        self.faults: dict[int, list[dict[str, Any]]] = {}

    # -- hooks -----------------------------------------------------------------------------
    @abstractmethod
    def train_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        """Train one round; the record's train_loss, steps and kept_tokens."""

    @abstractmethod
    def evaluate_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        """Score the test data; the record's test_accuracy and test_count."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned (nothing for a stateless server)."""

    # -- the loop ------------------------------------------------------------------------
    def run(self, grid: Grid, nodes: Sequence[int], first_round: int, num_rounds: int) -> list[dict[str, Any]]:
        """Rounds `first_round`..`num_rounds` with `nodes` in turn order (federation_partitions)."""
        records = []
        for round_ in range(first_round, num_rounds + 1):
            started = time.perf_counter()
            record = self.train_round(grid, round_, nodes)
            if self.evaluation_due(round_, num_rounds):
                record.update(self.evaluate_round(grid, round_, nodes))
            record.update(self.wire.ledger.round_totals(round_))
            record["bytes_per_client"] = self.wire.ledger.per_client(round_)
            record["round_trips_train"] = self.round_trips[round_, "train"]
            record["round_trips_eval"] = self.round_trips[round_, "evaluate"]
            if record.get("steps"):
                record["round_trips_per_step"] = record["round_trips_train"] / record["steps"]
            record["faults"] = self.faults.get(round_, [])
            record["wall_s"] = time.perf_counter() - started
            for callback in self.callbacks:
                callback.on_round_end(round_, record, self.state_dict())
            records.append(record)
        return records

    def evaluation_due(self, round_: int, num_rounds: int) -> bool:
        every = self.config.eval.every
        return every > 0 and (round_ % every == 0 or round_ == num_rounds)

    # -- one exchange with one client ------------------------------------------------------
    def exchange(
        self, grid: Grid, node: int, round_: int, message_type: str, config: dict[str, Any], tensors: dict | None = None
    ) -> RecordDict:
        """Send one message and wait for its reply: one round trip, counted and timed out.

        `tensors` are the payload the protocol says `message_type` carries (protocol.CARRIES);
        a replayed payload is shown to the wire's observers of what is sent.
        """
        content = RecordDict({protocol.CONFIG: ConfigRecord({"round": round_, **config})})
        broken = sorted(name for name, t in (tensors or {}).items() if t.is_floating_point() and not torch.isfinite(t).all())
        if broken:
            raise ServerFault(f"round {round_}: the server's own {message_type} holds non-finite values in {broken} "
                              "(its segment diverged; lower train.lr): the server's fault, not a client's")
        carried = protocol.CARRIES.get(message_type)
        if tensors is not None or carried is not None:
            names = set(tensors or {})
            if carried is None or names != carried.tensor_names:
                wanted = sorted(carried.tensor_names) if carried else "no tensors"
                raise ValueError(f"{message_type} carries {wanted} by the protocol, not {sorted(names)}")
            content[protocol.TENSORS] = self.wire.encode(tensors)
        self.wire.sent(round_, node, content, kind=carried.name if carried is not None and carried.replayed else None)
        message = Message(content=content, message_type=message_type, dst_node_id=node)
        reply = send_and_await(grid, message, self.config.faults.timeout_s)
        self.round_trips[round_, message_type.split(".")[0]] += 1
        if reply is None:
            raise ClientFault(f"no reply to {message_type} within faults.timeout_s={self.config.faults.timeout_s}s")
        if reply.has_error():
            raise ClientFault(f"{message_type} raised on the client: {reply.error.reason.strip()}")
        return reply.content

    def receive(
        self,
        round_: int,
        node: int,
        kind: protocol.TransferKind,
        content: RecordDict,
        *,
        check: Callable[[dict[str, torch.Tensor]], None] | None = None,
        **sizes: int,
    ) -> dict[str, torch.Tensor]:
        """A client's reply of `kind`, counted, checked against the protocol and shown to the observers."""
        return self.wire.received(round_, node, kind.name, content, kind.expectation(**sizes), check=check)

    def record_fault(self, round_: int, node: int, phase: str, error: Exception, consequence: str) -> None:
        reason = str(error)
        log.warning("round %d, client %d, %s: %s (%s)", round_, node, phase, reason.splitlines()[-1] if reason else "", consequence)
        self.faults.setdefault(round_, []).append(
            {"client": node, "phase": phase, "reason": reason[-2000:], "consequence": consequence}
        )


FAULTS = (ClientFault, WireError)


class Outcomes:
    """One evaluation's per-question outcomes, gathered from the clients' evaluation scores
    (training.protocol.QUESTIONS) for the run folder's outcomes.jsonl (callbacks.OutcomesLog)."""

    def __init__(self, zero_shot: bool = False) -> None:
        self.positions: list[int] = []
        self.scores: list[float] = []
        self.zero_shot: list[float] | None = [] if zero_shot else None

    def add(self, metrics: Mapping[str, Any]) -> None:
        """One evaluation score's questions; a score that does not list one per row it counts is the
        client's fault, and adds nothing (add it before its sum, so both leave it out)."""
        names = [protocol.QUESTIONS, protocol.QUESTION_SCORES]
        if self.zero_shot is not None:
            names.append(protocol.ZERO_SHOT_SCORES)
        lists = [list(metrics.get(name, [])) for name in names]
        count = metrics.get("count")
        if any(len(values) != count for values in lists):
            raise ClientFault(f"its evaluation score counts {count} rows but lists "
                              + ", ".join(f"{len(values)} {name}" for name, values in zip(names, lists, strict=True)))
        self.positions += lists[0]
        self.scores += lists[1]
        if self.zero_shot is not None:
            self.zero_shot += lists[2]

    def record(self) -> dict[str, Any]:
        """The round record's outcomes, in the test split's order."""
        order = sorted(range(len(self.positions)), key=self.positions.__getitem__)
        outcomes = {"positions": [self.positions[i] for i in order], "scores": [self.scores[i] for i in order]}
        if self.zero_shot is not None:
            outcomes["zero_shot"] = [self.zero_shot[i] for i in order]
        return {OUTCOMES: outcomes}


def pruning_record(content: RecordDict) -> PruningRecord:
    """The pruning record in a client's reply; a malformed one is the client's fault."""
    try:
        return PruningRecord.from_message_metrics(content.metric_records[protocol.METRICS])
    except (KeyError, ValueError) as error:
        raise ClientFault(f"malformed pruning metrics: {error}") from error


class GridWrapper(Grid):
    """A grid in front of the run's grid: subclasses change what `send_and_receive` does (FL's
    wire, SecAgg+'s tap); everything else is the inner grid's, and the one-way push and pull
    calls, which would bypass them, are refused."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return list(self.grid.send_and_receive(messages, timeout=timeout))

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError(f"{type(self).__name__} sends through send_and_receive only")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError(f"{type(self).__name__} receives through send_and_receive only")


def sample_level_budget(reports: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """DP-SGD's budget as a round's metrics: the clients' reports (privacy.dp_sgd.SampleLevelDP.spent)
    of the one that has spent the most (each client's privacy is its own; the run's is the worst)."""
    reports = list(reports)
    clip_only = [report for report in reports if "dp_clip_only" in report]
    reports = [report for report in reports if "dp_epsilon" in report]
    if not reports:
        # The clip-only control (privacy.dp.clip_only) spends no budget: it says so instead.
        return {"dp_clip_only": 1.0, "dp_releases": max(float(r["dp_releases"]) for r in clip_only)} if clip_only else {}
    worst = max(reports, key=lambda report: report["dp_epsilon"])
    return {key: float(worst[key]) for key in ("dp_epsilon", "dp_delta", "dp_releases", "dp_noise_multiplier")}


def wait_for_nodes(grid: Grid, count: int, timeout_s: float, *, exact: bool = True) -> list[int]:
    """The federation's node ids; fails if they are not `count` (with `exact=False`, fewer
    than `count`: CL's one trainer is picked from them, the rest idle)."""
    deadline = time.monotonic() + min(timeout_s, 120.0)
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if len(nodes) < count or (exact and len(nodes) != count):
        raise RuntimeError(
            f"the federation has {len(nodes)} nodes but clients.count={count}; run with "
            f"--federation-config 'num-supernodes={count}' (simulation) or start {count} SuperNodes"
        )
    return nodes


# Flower's Grid.send_and_receive sleeps between pulls (0.1 s in simulation, 3 s over HTTP),
# rounding every round trip up to its next pull; a USL step waits on two. The server pulls
# from 1 ms on, doubling up to REPLY_POLL_MAX_S, so a reply is picked up soon after it lands.
REPLY_POLL_MAX_S = 0.02


def send_and_await(grid: Grid, message: Message, timeout: float) -> Message | None:
    """`message`'s reply, or None after `timeout` seconds; a grid without push/pull (the
    in-process one, which answers at once) is asked with send_and_receive."""
    if not hasattr(grid, "pull_messages"):
        replies = list(grid.send_and_receive([message], timeout=timeout))
        return replies[0] if replies else None
    ids = set(grid.push_messages([message]))
    deadline, pause = time.monotonic() + timeout, 0.001
    while ids:
        replies = list(grid.pull_messages(ids))
        if replies:
            return replies[0]
        if time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, REPLY_POLL_MAX_S)
    return None


def federation_partitions(grid: Grid, config: SimConfig) -> dict[int, int]:
    """Node id -> partition id of the run's `clients.count` nodes, in partition order.

    Flower gives nodes random ids on every start; asking each node its partition makes
    the turn order, CL's trainer and FL's sampling and averaging the same whichever
    runtime runs the config, and on resume.
    """
    count, timeout = config.clients.count, config.faults.timeout_s
    nodes = wait_for_nodes(grid, count, timeout, exact=config.paradigm_spec.wire)
    queries = [
        Message(content=RecordDict(), message_type=protocol.PARTITION_QUERY, dst_node_id=node) for node in nodes
    ]
    replies = {reply.metadata.src_node_id: reply for reply in grid.send_and_receive(queries, timeout=timeout)}
    partitions = {}
    for node in nodes:
        reply = replies.get(node)
        if reply is None or reply.has_error():
            reason = reply.error.reason.strip() if reply is not None else f"no reply within faults.timeout_s={timeout}s"
            raise RuntimeError(f"node {node} did not say its partition ({protocol.PARTITION_QUERY}): {reason}")
        partitions[node] = int(reply.content.metric_records[protocol.METRICS][protocol.PARTITION_ID])
    ordered = sorted(partitions.items(), key=lambda item: (item[1], item[0]))[:count]
    held = [partition for _, partition in ordered]
    if len(set(held)) != len(held):
        raise RuntimeError(f"two nodes hold the same partition (node -> partition: {dict(ordered)}); "
                           "give every SuperNode its own partition-id")
    return dict(ordered)
