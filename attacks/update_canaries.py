"""The update-space audit of FL: canary clients the auditing server crafts, and the one-run bound.

An honest auditor (the server, declaring it: the run records its canaries) adds `m` canary
clients to the federation, each by a fair coin (Steinke, Nasr & Jagielski 2023: independent
inclusion with probability 1/2). A canary's update is a Dirac canary (Nasr et al. 2023;
Andrew et al. 2024): the clipping norm C on one adapter coordinate, with a random sign, each
canary on its own coordinate. The canaries the coin included join every round's aggregate as
clients of that round, before the DP wrapper's noise: each adds C/n to its coordinate, n the
clients averaged, the sensitivity the DP-FedAvg wrapper's noise (z·C/n) is calibrated to. Under
poisson sampling (clients.sampling) a canary joins a round by its own coin, as a real client does,
and n is the expected cohort. The
auditor's score of a canary is its coordinate's change, signed, summed over the rounds; the
one-run audit (attacks.metrics.one_run_audit) turns the scores of all canaries, included or not,
into a lower bound on the run's epsilon.

White-box and in update space, this is the strongest auditor an FL server can be: it needs no
model query and no data, and a canary's signal competes only with the noise and the real
clients' change to the same coordinate. `CanarySet` crafts and scores (the strategy wrapper
strategies.canary_audit puts it into a run); `UpdateCanaryAudit` is the registered attack that
reads the run's scores (`update_canaries.json`) and reports the bound beside the accountant's
epsilon.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attacks.base import ACTIVE, MEMBERSHIP, MODEL, Attack, AttackResult, Truth, register_attack
from attacks.context import ReplayContext, accounted_epsilon
from attacks.metrics import one_run_audit
from attacks.recording import Recording
from vqa import VQASample

UPDATE_CANARIES_FILE = "update_canaries.json"


class CanarySet:
    """`count` Dirac canaries over the adapters of `shapes` (name -> shape, in the order FedAvg
    averages them): each on its own coordinate with a random sign, each included by a fair coin;
    all drawn from `seed`. Scores accumulate per round (`score_round`), keyed by the round, so a
    resumed run drops the rounds its checkpoint does not hold."""

    def __init__(self, count: int, shapes: Mapping[str, Sequence[int]], seed: int) -> None:
        sizes = [int(np.prod(shape)) for shape in shapes.values()]
        total = sum(sizes)
        if not 2 <= count <= total:
            raise ValueError(f"update canaries: {count}; allowed: 2 to the adapters' {total} coordinates, one each")
        rng = np.random.default_rng(seed)
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.offsets = dict(zip(self.shapes, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True))
        self.coordinates = rng.choice(total, size=count, replace=False)
        self.signs = rng.choice([-1.0, 1.0], size=count)
        self.included = rng.random(count) < 0.5
        self.round_scores: dict[int, np.ndarray] = {}

    @property
    def count(self) -> int:
        return len(self.coordinates)

    def _flat(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[name], dtype=np.float64).ravel() for name in self.shapes])

    def contribution(self, norm: float, clients: int, joining: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """What the included canaries add to a round's average over `clients`: each its update
        (`norm` on its coordinate, signed) weighted as one client, 1/clients. `joining`: which
        canaries the round's sampling drew (None: all), as it draws real clients."""
        present = self.included if joining is None else self.included & joining
        flat = np.zeros(sum(int(np.prod(shape)) for shape in self.shapes.values()))
        flat[self.coordinates[present]] = self.signs[present] * norm / clients
        return {name: flat[offset: offset + int(np.prod(shape))].reshape(shape).astype(np.float32)
                for (name, shape), offset in zip(self.shapes.items(), self.offsets.values(), strict=True)}

    def score_round(self, round_: int, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> None:
        """Each canary's signed change of its coordinate from `before` to `after` (the global
        adapters around round `round_`'s aggregation, noise included)."""
        change = self._flat(after) - self._flat(before)
        self.round_scores[round_] = self.signs * change[self.coordinates]

    def to_json(self) -> dict[str, Any]:
        return {"coordinates": self.coordinates.tolist(), "signs": self.signs.tolist(),
                "included": self.included.tolist(),
                "round_scores": {str(r): s.tolist() for r, s in sorted(self.round_scores.items())}}

    def load_scores(self, saved: Mapping[str, Any], through: int) -> None:
        """The scores a previous start saved for rounds up to `through` (its last committed
        round), checked to be of these canaries."""
        if saved.get("coordinates") != self.coordinates.tolist() or saved.get("included") != self.included.tolist():
            raise ValueError(f"{UPDATE_CANARIES_FILE} holds other canaries than this run's seed and adapters draw")
        self.round_scores = {int(r): np.asarray(s) for r, s in saved["round_scores"].items() if int(r) <= through}


def read_scores(folder: Path, through: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores summed over rounds up to `through`, inclusion flags) of a run's update canaries."""
    path = folder / UPDATE_CANARIES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run had no update canaries (threat.update_canaries = 0)")
    saved = json.loads(path.read_text())
    rounds = [np.asarray(s) for r, s in saved["round_scores"].items() if int(r) <= through]
    if not rounds:
        raise ValueError(f"{path} holds no scored round up to round {through}")
    return np.sum(rounds, axis=0), np.asarray(saved["included"], dtype=bool)


@dataclass
class UpdateAuditOptions:
    # The confidence of the lower bound.
    confidence: float = 0.95


class UpdateCanaryAudit(Attack):
    """The one-run lower bound on epsilon from a run's update canaries (threat.update_canaries)."""

    name = "update_audit"
    threat_model = ACTIVE
    kind = MEMBERSHIP
    reads = (MODEL,)
    headline = ("audit_epsilon",)
    Options = UpdateAuditOptions

    def fit(self, aux: Sequence[VQASample]) -> "UpdateCanaryAudit":
        if not 0 < self.options.confidence < 1:
            raise ValueError(f"confidence={self.options.confidence}; allowed: a probability in (0, 1)")
        return self

    def prepare_replay(self, run: ReplayContext) -> None:
        """The canaries' scores through the run's last committed round, the audit's delta (the
        run's privacy.dp.delta) and the epsilon its accountant reports."""
        committed = run.folder / "committed.json"
        if not committed.exists():
            raise FileNotFoundError(f"{run.folder} has no committed round: the run never finished one")
        self.scores, self.included = read_scores(run.folder, json.loads(committed.read_text())["round"])
        self.delta = run.config.privacy.dp.delta
        self.accounted = accounted_epsilon(run)

    def run(self, recording: Recording | None, truth: Truth | None = None) -> AttackResult:
        if not hasattr(self, "scores"):
            raise ValueError("update_audit reads a run's canary scores: replay it on a run (prepare_replay)")
        metrics = one_run_audit(self.scores, self.included, self.delta, confidence=self.options.confidence)
        return AttackResult(self.name, metrics={**metrics, **self.accounted},
                            details={"included": int(self.included.sum())})


register_attack(UpdateCanaryAudit)
