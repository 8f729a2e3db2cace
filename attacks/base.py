"""The one interface every attack implements, and the registry that names them.

An attack is built from the attacker's knowledge (attacks.knowledge) and its own
options, trained offline on public data (`fit`), then run on what the server
recorded (`run`). Its result holds metrics — only when a `Truth` is given, since
scoring needs the victims' real inputs, which the attacker never has — and its raw
outputs (reconstructed images, recovered tokens) for inspection.

Each attack module ends with `register_attack(TheAttack)` (attacks/__init__.py imports every
module of the package, so a new module is registered by being there); the replay command and
`build_attack` find attacks by name only through this registry, and the results tables
(analysis/) read what each attack declares of itself: its kind, what it reads and its
headline metrics.
"""

import json
import math
import os
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from safetensors.torch import save_file

from attacks.knowledge import AttackerKnowledge
from attacks.recording import RecordedTransfer, Recording
from registry import Registry
from vqa import VQASample
from vqa.stamping import MarkRecord

if TYPE_CHECKING:
    from attacks.context import ReplayContext
    from config import SimConfig

# What an attack recovers.
IMAGE, TEXT, LABEL, MEMBERSHIP = "image", "text", "label", "membership"
KINDS = {IMAGE: "the client's images", TEXT: "the prompt's tokens", LABEL: "the answers a client trains on",
         MEMBERSHIP: "which samples a model or a release was trained on"}
# What of a run an attack reads.
ACTIVATION, GRADIENT, UPDATE, MODEL, TASK_VECTOR = "activation", "gradient", "update", "model", "task_vector"
READS = {ACTIVATION: "the activation a split client sends at the first cut",
         GRADIENT: "the gradient a USL client returns at CB", UPDATE: "an FL client's adapter update",
         MODEL: "the trained model, queried as a black box", TASK_VECTOR: "the released task vector"}
PASSIVE, ACTIVE, QUERY = "passive", "active", "query"
THREAT_MODELS = {PASSIVE: "an honest-but-curious server", ACTIVE: "a server that deviates from the protocol",
                 QUERY: "black-box access to the model"}


class Truth(Protocol):
    """The victims' side of a recording, for scoring only."""

    def samples(self, entry: RecordedTransfer) -> list[VQASample] | None:
        """The samples behind a recorded transfer, in its order (None: not known)."""

    def keep_sets(self, entry: RecordedTransfer) -> list[torch.Tensor] | None:
        """Per sample, the patch indices the client sent, in the order it sent them (None: not known)."""

    def membership(self) -> tuple[list[VQASample], list[VQASample]]:
        """Candidates for membership inference: (members, non-members)."""

    def canaries(self) -> tuple[list[VQASample], list[VQASample]] | None:
        """The audit's canaries, (included, excluded), each included by a fair coin (data.canaries);
        None when the run has none."""

    def mark(self, sample: VQASample) -> MarkRecord | None:
        """The stamped benchmark's mark in a sample's image (None: a plain image)."""


@dataclass
class AttackResult:
    """Headline metrics (with their trivial baselines), settings and per-item details, raw outputs."""

    attack: str
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def save(self, folder: str | Path) -> Path:
        """`<folder>/<attack>.safetensors` (outputs), then `<attack>.json` (metrics, details), each
        written beside its place and moved over it: the JSON, which says the result exists, only
        once both are whole."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.outputs:
            partial = folder / f".{self.attack}.safetensors.partial"
            save_file({k: v.detach().cpu().contiguous() for k, v in self.outputs.items()}, str(partial))
            os.replace(partial, folder / f"{self.attack}.safetensors")
        path = folder / f"{self.attack}.json"
        partial = folder / f".{self.attack}.json.partial"
        partial.write_text(json.dumps({"attack": self.attack, "metrics": self.metrics, "details": self.details},
                                      indent=2, sort_keys=True, default=str))
        os.replace(partial, path)
        return path


class Attack(ABC):
    """Subclasses set `name`, `threat_model`, `kind`, `reads`, `headline` and `Options` (a dataclass
    of their settings)."""

    name: ClassVar[str]
    # One of THREAT_MODELS: who the attacker is.
    threat_model: ClassVar[str]
    # One of KINDS: what it recovers.
    kind: ClassVar[str]
    # Of READS: what of the run it reads (which a run must record for it).
    reads: ClassVar[tuple[str, ...]]
    # The metrics of its result that stand for its success in the results tables (the first: the
    # one the tables lead with); each result reports them beside their trivial baselines.
    headline: ClassVar[tuple[str, ...]]
    Options: ClassVar[type]
    # Whether `fit` reads the run itself (state prepare_replay took from it) besides public data;
    # an attack whose fit does not is fitted once and replayed on every run of the same public setting.
    fit_reads_run: ClassVar[bool] = False

    @classmethod
    def fit_adapts_to_defenses(cls, options: Mapping[str, Any]) -> bool:
        """Whether an attack built with `options` fits to the run's defenses (then it is fitted
        once per defense setting, else once for every defended run of a public setting)."""
        return False

    def __init__(self, knowledge: AttackerKnowledge, **options: Any) -> None:
        self.knowledge = knowledge
        self.options = checked_options(self.name, self.Options, options)

    @classmethod
    def options_from_run(cls, config: "SimConfig") -> dict[str, Any]:
        """Options a run's config sets (a replay's own override them): an active attack is
        rebuilt as the server that ran, with that server's settings."""
        return {}

    @abstractmethod
    def fit(self, aux: Sequence[VQASample]) -> "Attack":
        """Train what does not depend on the observations, on public (auxiliary) samples."""

    def prepare_replay(self, run: "ReplayContext") -> None:
        """Take from a recorded run what this attack needs besides the recording (before `fit`).

        Passive attacks need nothing more; an active attack takes the server state it kept
        during the run (so `fit` need not train what that state replaces), a query attack
        gets its target model.
        """

    @abstractmethod
    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        """Attack what the recording holds; score against `truth` when given."""


class AttackOptionError(ValueError):
    """An attack option that is unknown or not allowed; the message names it, its value and what is allowed."""


def _tuple_arity(annotation: Any) -> int | None:
    """How many numbers a fixed-length tuple option takes (`tuple[float, float] | None`: 2); None
    for an option that is not one."""
    for kind in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(kind) is tuple and Ellipsis not in typing.get_args(kind):
            return len(typing.get_args(kind))
    return None


def checked_options(attack: str, options_class: type, options: Mapping[str, Any]) -> Any:
    """The attack's Options from `options`, each of its default's kind. Every number an attack
    takes is a count, a rate, a weight or a seed: none is negative, infinite or nan."""
    declared = {f.name: f for f in fields(options_class)}
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise AttackOptionError(f"{attack}: unknown option {unknown[0]!r}; allowed: {', '.join(declared)}")
    for name, value in options.items():
        default = declared[name].default
        # A pair such as SARA's keep_ratios: JSON's list on the command line, a tuple in Python.
        arity = _tuple_arity(declared[name].type)
        if arity is not None:
            if not (isinstance(value, (list, tuple)) and len(value) == arity and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                    for v in value)):
                raise AttackOptionError(f"{attack}: option {name}={value!r} is not allowed; allowed: a list of "
                                        f"{arity} finite numbers >= 0, e.g. {list(default or (0.0,) * arity)}")
            continue
        if isinstance(default, str) and not isinstance(value, str):
            raise AttackOptionError(f"{attack}: option {name}={value!r} is not allowed; allowed: a string like its "
                                    f"default {default!r}")
        if isinstance(default, bool) or isinstance(value, bool):
            if not isinstance(value, bool) or not isinstance(default, bool):
                raise AttackOptionError(f"{attack}: option {name}={value!r} is not allowed; allowed: "
                                        f"{'true or false' if isinstance(default, bool) else 'a number'}")
        elif isinstance(value, (int, float)):
            if isinstance(default, int) and not isinstance(value, int):
                raise AttackOptionError(f"{attack}: option {name}={value!r} is not allowed; allowed: an integer >= 0")
            if not (math.isfinite(value) and value >= 0):
                raise AttackOptionError(f"{attack}: option {name}={value!r} is not allowed; allowed: a finite number >= 0")
        elif isinstance(default, (int, float)):
            raise AttackOptionError(f"{attack}: option {name}={value!r} is not allowed; allowed: a number like its "
                                    f"default {default!r}")
    return options_class(**options)


def _check_attack(attack: type[Attack]) -> None:
    for attribute in ("threat_model", "kind", "reads", "headline"):
        if not hasattr(attack, attribute):
            raise ValueError(f"attack {attack.name!r} does not declare its {attribute}")
    for attribute, value, allowed in (("threat_model", (attack.threat_model,), THREAT_MODELS),
                                      ("kind", (attack.kind,), KINDS), ("reads", attack.reads, READS)):
        if not value or not set(value) <= set(allowed):
            raise ValueError(f"attack {attack.name!r}: {attribute}={value!r}; allowed: {', '.join(allowed)}")
    if not attack.headline:
        raise ValueError(f"attack {attack.name!r}: headline=(); allowed: the names of one or more of its metrics")


ATTACKS: Registry[type[Attack]] = Registry("attack", check=_check_attack)
register_attack, attack_class = ATTACKS.register, ATTACKS.get


def available_attacks() -> list[str]:
    return sorted(ATTACKS.names())


def build_attack(name: str, knowledge: AttackerKnowledge, **options: Any) -> Attack:
    return attack_class(name)(knowledge, **options)
