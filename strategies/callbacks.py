"""Cross-cutting concerns of a run as callbacks: the run folder, metrics, checkpoints, status.

A run folder holds `config.json` (the resolved config), `metrics.jsonl` (one line
per round), `outcomes.jsonl` (one line per evaluated round: each question's score),
`checkpoints/` (the server's state after each round), `committed.json` (the last round
whose checkpoint is complete), `canaries.json` (data.canaries: the membership
audit's canaries), `nodes.json` (node id -> partition id
of every node that served the run: Flower's node ids change with each start, and a
recording names nodes) and `status.json` (running, finished or failed with the reason;
the server's threat model and the defenses its clients applied) — the truth that `flwr run --stream`'s exit code is not.
"""

import json
import logging
import os
import threading
import time
import traceback
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from config import RESUMABLE_KEYS, SimConfig
from training.data import RunData
from training.defenses import describe_defenses, describe_dp
from training.protocol import NODE_PARTITIONS_FILE, OUTCOMES_FILE
from vlm.loading import describe_weights


log = logging.getLogger(__name__)

CANARIES_FILE = "canaries.json"
# A round record's per-question outcomes (strategies.base.Outcomes): OutcomesLog writes them to
# outcomes.jsonl, and metrics.jsonl leaves them out.
OUTCOMES = "outcomes"
# States of a run whose server is at work; its status.json's heartbeat is renewed every
# HEARTBEAT_S, and one older than STALE_AFTER_S means the server died without saying so.
LIVE_STATES = ("starting", "running")
HEARTBEAT_S = 30.0
STALE_AFTER_S = 4 * HEARTBEAT_S


def write_text_atomically(path: Path, text: str) -> None:
    """`text` at `path`, never torn: written beside it, then moved over it."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_json_atomically(path: Path, data: Any) -> None:
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True))


class RunCallback(Protocol):
    def on_round_end(self, round_: int, metrics: dict[str, Any], state: dict[str, Any]) -> None: ...


class RunFolder:
    """A run's folder; refuses to resume a folder written by a different config or whose rounds
    were trained on other weights (a rebuilt mini)."""

    def __init__(self, config: SimConfig, path: Path) -> None:
        self.path = path
        self.config = config
        # The status last written, and a lock so that the heartbeat never writes an older one over it.
        self.status: dict[str, Any] = {}
        self._status_lock = threading.Lock()
        # What the run measures: a result names the weights (a mini build's digest), not only the recipe.
        self.weights = describe_weights(config.model.profile, config.model.stage, config.model.source)
        path.mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
        previous = path / "config.json"
        if previous.exists() and self.committed_round() > 0 and not config.output.resume:
            raise FileExistsError(
                f"run folder {path} already holds {self.committed_round()} rounds and output.resume=false; "
                "choose another output.name or set output.resume=true"
            )
        changed = changed_since_written(config, path)
        if changed:
            raise ValueError(
                f"run folder {path} was written by a different config (changed: {changed}); only "
                f"{', '.join(RESUMABLE_KEYS)} may change on resume — use another output.name"
            )
        trained_on = self._weights_trained_on()
        # A side not built yet names no weights to compare (a run may start before its first load builds them).
        if trained_on and trained_on != self.weights and "not built" not in trained_on + self.weights:
            raise ValueError(
                f"run folder {path} was trained on {trained_on}, but {config.model.profile} now loads "
                f"{self.weights}: its rounds belong to another model — use another output.name"
            )
        if config.train.rounds < self.committed_round():
            raise ValueError(f"run config train.rounds={config.train.rounds} is not allowed; allowed: >= "
                             f"{self.committed_round()}, the rounds run folder {path} already holds")
        write_json_atomically(previous, {"config": config.to_flat(), "fingerprint": config.fingerprint()})

    def committed_round(self) -> int:
        return committed_round(self.path)

    def _weights_trained_on(self) -> str | None:
        """The weights the folder's committed rounds were trained on (its last status), if any."""
        status = self.path / "status.json"
        if not self.committed_round() or not status.is_file():
            return None
        try:
            return json.loads(status.read_text()).get("weights")
        except json.JSONDecodeError:
            return None  # a torn status says nothing about the weights; the checkpoints are what resume

    def checkpoint_path(self, round_: int) -> Path:
        return self.path / "checkpoints" / f"round-{round_:06d}.pt"

    def load_checkpoint(self) -> dict[str, Any] | None:
        committed = self.committed_round()
        return torch.load(self.checkpoint_path(committed), weights_only=True) if committed else None

    def record_nodes(self, partitions: Mapping[int, int]) -> None:
        """Add this start's node -> partition map to `nodes.json`; a resumed run keeps the earlier
        starts' nodes, whose transfers its recording still holds."""
        path = self.path / NODE_PARTITIONS_FILE
        known = json.loads(path.read_text()) if path.exists() and self.committed_round() else {}
        write_json_atomically(path, {**known, **{str(node): partition for node, partition in partitions.items()}})

    def record_canaries(self, data: RunData) -> None:
        """`canaries.json`: the membership audit's canaries (data.canaries) with the random answer
        each was given, so an audit can be checked against what the run trained on."""
        def rows(samples: Any) -> list[dict[str, str]]:
            return [{"id": s.id, "image_id": s.image_id, "question": s.question, "answer": s.answer} for s in samples]

        write_json_atomically(self.path / CANARIES_FILE, {"members": rows(data.canary_members),
                                                          "non_members": rows(data.canary_non_members)})

    def write_status(self, state: str, **details: Any) -> None:
        now = time.time()
        with self._status_lock:
            self.status = {"state": state, "time": now, "heartbeat": now, "weights": self.weights,
                           "threat_model": self.config.threat.model,
                           "defenses": describe_defenses(self.config), "dp": describe_dp(self.config), **details}
            write_json_atomically(self.path / "status.json", self.status)

    def beat(self) -> None:
        """A live run's status.json gets a fresh `heartbeat` time (a state that ended keeps its own)."""
        with self._status_lock:
            if self.status.get("state") in LIVE_STATES:
                self.status["heartbeat"] = time.time()
                write_json_atomically(self.path / "status.json", self.status)


class Heartbeat:
    """Beats the run folder's status every `every` seconds while the server runs, so a reader can
    tell a run that is working from one whose server died ("running" forever): `is_stale`."""

    def __init__(self, folder: RunFolder, every: float = HEARTBEAT_S) -> None:
        self.folder, self.every = folder, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qpriv-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.folder.beat()

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def is_stale(status: Mapping[str, Any], now: float | None = None) -> bool:
    """A status that says its run is live but has not beaten for STALE_AFTER_S: its server died
    (killed, `flwr stop`) without writing an end."""
    if status.get("state") not in LIVE_STATES:
        return False
    last = status.get("heartbeat", status.get("time", 0))
    return (time.time() if now is None else now) - last > STALE_AFTER_S


def committed_round(path: Path) -> int:
    """The last round whose checkpoint the run folder holds complete (0: none)."""
    marker = path / "committed.json"
    return json.loads(marker.read_text())["round"] if marker.exists() else 0


def changed_since_written(config: SimConfig, path: Path) -> list[str]:
    """The keys whose values differ from those of the config that wrote the run folder's
    completed rounds (empty: none, or nothing to resume); resumable keys never count, nor a
    key the writing build did not have that is at its default (the schema grew around it)."""
    previous = path / "config.json"
    if not previous.exists() or not (path / "committed.json").exists():
        return []
    if json.loads(previous.read_text())["fingerprint"] == config.fingerprint():
        return []
    return written_differences(config.to_flat(), path)


def written_differences(flat: Mapping[str, Any], path: Path) -> list[str]:
    """The keys of `flat` (a flat run config) whose values differ from the run folder's
    config.json; resumable keys never count, nor a key the writing build did not have that
    is at its default."""
    written = json.loads((path / "config.json").read_text())["config"]
    defaults = SimConfig().to_flat()
    return sorted(key for key, value in flat.items()
                  if key not in RESUMABLE_KEYS and written.get(key, defaults.get(key)) != value)


def keep_committed_lines(path: Path, committed: int) -> None:
    """A round log (JSON lines with a "round") without the lines past round `committed`: a resumed
    run writes those rounds again."""
    if not path.exists():
        return
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            round_ = json.loads(line)["round"]
        except (json.JSONDecodeError, KeyError, TypeError):
            # A line is written before its round's checkpoint commits: a torn one is of a
            # round that never committed, and goes like every line past the checkpoint.
            log.warning("%s line %d is torn (a kill mid-write); dropped with the uncommitted rounds", path, number)
            continue
        if round_ <= committed:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))


class MetricsLog:
    """metrics.jsonl, one line per committed round (its outcomes aside: OutcomesLog); a resumed run
    drops lines past the checkpoint."""

    def __init__(self, folder: RunFolder) -> None:
        self.path = folder.path / "metrics.jsonl"
        keep_committed_lines(self.path, folder.committed_round())

    def on_round_end(self, round_: int, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        line = {"round": round_, **{key: value for key, value in metrics.items() if key != OUTCOMES}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(line, sort_keys=True) + "\n")


class OutcomesLog:
    """outcomes.jsonl, one line per evaluated round: each question scored, in the test split's order,
    as `questions` (VQASample ids), `positions` (in the run's test split: training.protocol.QUESTIONS)
    and `scores` (MTV: and `zero_shot`), parallel lists; a round whose evaluation lost a client lists
    only the questions scored, whose mean is the round's test_accuracy. One line per round, so a kill
    mid-write leaves a line that does not parse rather than a round that looks whole; a resumed run
    drops lines past the checkpoint, as MetricsLog does. `questions` is left out where this server
    cannot load the test split (a deployment that keeps the data on the nodes)."""

    def __init__(self, folder: RunFolder) -> None:
        self.path = folder.path / OUTCOMES_FILE
        self.config = folder.config
        # The test split's ids, loaded at the first evaluated round (None: not loaded, or not loadable).
        self._ids: list[str] | None = None
        self._loaded = False
        keep_committed_lines(self.path, folder.committed_round())

    def question_ids(self) -> list[str] | None:
        if not self._loaded:
            self._loaded = True
            try:
                self._ids = [sample.id for sample in RunData.build(self.config).test_all]
            except (OSError, ValueError) as error:
                log.warning("%s names questions by position only: the test split does not load here (%s)",
                            self.path, error)
        return self._ids

    def on_round_end(self, round_: int, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        if OUTCOMES not in metrics:
            return
        outcomes = dict(metrics[OUTCOMES])
        ids = self.question_ids()
        if ids is not None:
            outcomes["questions"] = [ids[position] for position in outcomes["positions"]]
        with self.path.open("a") as handle:
            handle.write(json.dumps({"round": round_, **outcomes}, sort_keys=True) + "\n")


class Checkpointer:
    """The server's state after each round; `committed.json` moves only once the file is whole."""

    def __init__(self, folder: RunFolder, keep: int = 2) -> None:
        self.folder, self.keep = folder, keep

    def on_round_end(self, round_: int, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        target = self.folder.checkpoint_path(round_)
        partial = target.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, target)
        write_json_atomically(self.folder.path / "committed.json", {"round": round_})
        for old in sorted(self.folder.path.glob("checkpoints/round-*.pt"))[: -self.keep]:
            old.unlink()


class StatusReporter:
    """status.json after every round, so a killed run shows how far it got; a DP run's status also
    says the budget spent (`spent`: as of the last committed round, also for the final status)."""

    def __init__(self, folder: RunFolder, num_rounds: int) -> None:
        self.folder, self.num_rounds = folder, num_rounds
        log = folder.path / "metrics.jsonl"
        lines = [line for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        self.spent = privacy_spent(json.loads(lines[-1])) if lines else {}

    def on_round_end(self, round_: int, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        self.spent = privacy_spent(metrics)
        self.folder.write_status("running", round=round_, rounds=self.num_rounds, **self.spent)


def participation(folder: RunFolder, test_rows: int | None) -> dict[str, Any]:
    """Who took part, from metrics.jsonl: per round the partitions (by nodes.json) that a fault
    left out, the share of the `test_rows` the last scored round scored (None: not known or never
    scored), and `complete`: no client left out and every test row scored."""
    log, nodes_file = folder.path / "metrics.jsonl", folder.path / NODE_PARTITIONS_FILE
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    nodes = json.loads(nodes_file.read_text()) if nodes_file.exists() else {}
    failed = {str(r["round"]): sorted({nodes.get(str(f["client"]), f["client"]) for f in r["faults"]})
              for r in records if r.get("faults")}
    scored = [r["test_count"] for r in records if r.get("test_count") is not None]
    share = scored[-1] / test_rows if scored and test_rows else None
    return {"complete": not failed and (share is None or share >= 1), "failed_partitions": failed, "test_share": share}


def privacy_spent(metrics: dict[str, Any]) -> dict[str, Any]:
    """The budget a DP run has spent, from a round's metrics (privacy.dp.PrivacyBudget.spent,
    privacy.dp_sgd.SampleLevelDP.spent)."""
    return {"privacy_spent": {key: metrics[key] for key in metrics if key.startswith("dp_")}} if "dp_epsilon" in metrics else {}


def failure_details(error: BaseException) -> dict[str, str]:
    return {
        "error_type": type(error).__name__,
        "error": str(error),
        "traceback": "".join(traceback.format_exception(error))[-4000:],
    }
