"""The one interface every defense implements, and the registry that names them.

A defense runs on the client, inside its graph, before the wire: whatever it returns
is what the wire encodes, the server receives, the recorder stores and every attack
reads. Each defense names the stage it acts at:

- ACTIVATION: the packed activation a split client sends at the first cut (SL: C, USL: CA);
- GRADIENT: the packed gradient a USL client returns at CB;
- LOSS: a term added to the client front's training loss (it leaves the payload as it is);
- EDGE: the visual tokens the client's vision tower forms, inside the tower (privacy.edge:
  its payload is `EdgeTokens`, not a `Payload`).

`Defense.apply(payload, seed)` returns `Defended`: the defended payload and its metrics (the
shape of pfl's `Postprocessor.postprocess_one_user`); a chain of none is the null object and
returns the payload's very tensor. A defense's perturbation (noise, masks, directions)
is data, not a function of the weights: gradients flow through the defended rows as
they flow through `rows * mask + delta` with mask and delta fixed.

A defense that draws random numbers draws them only from `seed.generator()`, seeded
by (privacy seed, client, round, step, phase, defense), so a front recomputed in a
fresh process sends the payload the first computation sent.

Each defense module ends with `register_defense(TheDefense)` (privacy/__init__.py imports
every module of the package, so a new module is registered by being there); its `Options`
dataclass owns the defaults, documents them and checks them (`validate` raises OptionError,
which the run config reports under the key `privacy.<name>.<option>`), and its `strength`
names the option a sweep varies.
"""

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Generic, TypeVar

import torch

from registry import OptionError, Registry, check_names_an_option  # noqa: F401  (OptionError: the defenses' modules import it from here)
from vlm.paradigms import PARADIGMS, Paradigm

ACTIVATION = "activation"
GRADIENT = "gradient"
LOSS = "loss"
EDGE = "edge"
# What each stage acts on, and the decoder cuts a paradigm needs for its client to have it (the
# gradient at CB comes back to a client that holds the tail, behind the second cut).
STAGES = {
    ACTIVATION: ("the activation a split client sends at the first cut", 1),
    GRADIENT: ("the gradient a USL client returns at CB", 2),
    LOSS: ("the client front's training loss", 1),
    EDGE: ("the visual tokens a split client's vision tower forms", 1),
}
# Phases of a client's computation: a training step, or one token of greedy evaluation.
TRAIN, EVAL = "train", "eval"


def client_stages(paradigm: Paradigm) -> tuple[str, ...]:
    """The stages a client of `paradigm` has."""
    return tuple(stage for stage, (_, cuts) in STAGES.items() if paradigm.cuts >= cuts)


def stage_paradigms(stage: str) -> list[str]:
    """The paradigms whose clients have `stage`."""
    return [paradigm.name for paradigm in PARADIGMS if stage in client_stages(paradigm)]


@dataclass(frozen=True)
class DefenseSeed:
    """Where in a run a payload is defended; every random draw of a defense comes from here."""

    seed: int
    client: int
    round: int
    step: int
    phase: str = TRAIN

    def per_batch(self) -> "DefenseSeed":
        """The seed without the greedy token's index ("eval:3" -> "eval"): what EDGE defenses draw
        from, since a client's vision tower forms an image's tokens once per answer."""
        return replace(self, phase=self.phase.partition(":")[0])

    def generator(self, defense: str, device: torch.device | str = "cpu") -> torch.Generator:
        key = json.dumps([self.seed, self.client, self.round, self.step, self.phase, defense])
        value = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
        return torch.Generator(device=device).manual_seed(value)


@dataclass(frozen=True)
class Payload:
    """What a defense acts on: packed rows [n, D] (an activation or a gradient) and each
    sample's row count [B]. For the first cut also the front's input rows (the decoder's
    input embeddings, packed the same way) and the front as a function of them, for
    defenses that look through the front (PriPert's Jacobian, NoPeek's correlation)."""

    rows: torch.Tensor
    lengths: torch.Tensor
    inputs: torch.Tensor | None = None
    front: Callable[[torch.Tensor], torch.Tensor] | None = None

    def samples(self, tensor: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`tensor` (default: the rows) split into each sample's rows."""
        tensor = self.rows if tensor is None else tensor
        return list(torch.split(tensor, self.lengths.to(torch.long).tolist()))

    def needs(self, defense: str, *names: str) -> None:
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"defense {defense!r} needs the payload's {missing} (it acts at the first cut)")


Rows = TypeVar("Rows")


@dataclass
class Defended(Generic[Rows]):
    """A defense's output: the rows to send (an EDGE defense: the tower's `EdgeTokens`), a loss
    term for the client (LOSS stage) and metrics."""

    rows: Rows
    loss: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Defense(ABC):
    """Subclasses set `name`, `stage`, `Options` (a dataclass with `validate()`), `strength` and `random`."""

    name: ClassVar[str]
    stage: ClassVar[str]
    Options: ClassVar[type]
    # The option that sets how strongly it defends, the one a sweep varies (the privacy-utility
    # frontier's x axis); None: it has no such dial.
    strength: ClassVar[str | None]
    # Whether `apply` draws random numbers (then only from the seed's generator).
    random: ClassVar[bool] = False

    @classmethod
    def strength_option(cls, options: Any) -> str | None:
        """The option that sets the strength of this defense with `options` (a defense whose
        variants have different dials says which one this variant turns)."""
        return cls.strength

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options
        check_options(type(self), self.options)

    @abstractmethod
    def apply(self, payload: Payload, seed: DefenseSeed) -> Defended[torch.Tensor]:
        """The defended payload and what the defense measured on it."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "stage": self.stage, "options": asdict(self.options)}


def _check_defense(defense: type[Defense]) -> None:
    if not hasattr(defense, "strength"):
        raise ValueError(f"defense {defense.name!r} does not declare its strength (an option, or None)")
    if defense.stage not in STAGES:
        raise ValueError(f"defense {defense.name!r}: stage={defense.stage!r}; allowed: {sorted(STAGES)}")
    if not defense.name.isidentifier():
        raise ValueError(f"defense name {defense.name!r} must be an identifier (it is a config key)")
    check_names_an_option("defense", defense, "strength")


DEFENSES: Registry[type[Defense]] = Registry("defense", check=_check_defense)
register_defense, defense_class, defense_names = DEFENSES.register, DEFENSES.get, DEFENSES.names


def check_options(defense: type[Defense], options: Any) -> None:
    if not isinstance(options, defense.Options):
        raise TypeError(f"defense {defense.name!r} takes {defense.Options.__name__}, not {type(options).__name__}")
    options.validate()


def parse_defense_names(text: str) -> list[str]:
    """`privacy.defenses` ("noise,sparsify"; "" or "none": none) as names, in order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    return [] if names == ["none"] else names


class DefenseChain:
    """The active defenses in their configured order; a chain of none changes nothing."""

    def __init__(self, defenses: Iterable[Defense] = (), *, seed: int = 0) -> None:
        self.defenses = tuple(defenses)
        self.seed = seed

    @classmethod
    def build(cls, names: Sequence[str], options: Mapping[str, Any], *, seed: int = 0) -> "DefenseChain":
        """Defenses `names` with `options[name]` (their Options; missing: the defaults)."""
        if len(set(names)) != len(names):
            raise ValueError(f"defenses {list(names)} name one twice; each takes one set of options")
        return cls([defense_class(name)(options.get(name)) for name in names], seed=seed)

    @property
    def names(self) -> list[str]:
        return [defense.name for defense in self.defenses]

    def at(self, stage: str) -> tuple[Defense, ...]:
        return tuple(defense for defense in self.defenses if defense.stage == stage)

    def acts_at(self, *stages: str) -> bool:
        return any(defense.stage in stages for defense in self.defenses)

    def seed_for(self, client: int, round_: int, step: int, phase: str = TRAIN) -> DefenseSeed:
        return DefenseSeed(self.seed, client, round_, step, phase)

    def apply(self, stages: Sequence[str], payload: Payload, seed: DefenseSeed) -> Defended:
        """The defenses acting at `stages`, in order, each on the previous one's rows; their
        loss terms summed, their metrics under `<name>.<metric>`."""
        out = Defended(payload.rows)
        for defense in self.defenses:
            if defense.stage not in stages:
                continue
            result = defense.apply(replace(payload, rows=out.rows), seed)
            out.rows = result.rows
            if result.loss is not None:
                out.loss = result.loss if out.loss is None else out.loss + result.loss
            out.metrics.update({f"{defense.name}.{key}": value for key, value in result.metrics.items()})
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Which defenses run, where and with which options (status.json, the recording's header)."""
        return [defense.describe() for defense in self.defenses]
