"""The one interface every pruning policy implements, and the registry that names them.

Every policy builds a VisualTokenSelector, which runs on the client between the frozen
vision tower and the projector and returns a Selection: per sample, the ascending indices
of the patches to keep, and the sensitivity map it ranked with (one pass of a scorer gives
both). The indices never leave the client; only the kept tokens' activations do. A merging
policy (VisionZip's contextual tokens) also gives each kept position the mix of patch rows
its token is made of: `Selection.rows` is what is sent, `Selection.sources` whose content.

A policy is a `PolicySpec` registered by name. Its `Options` dataclass holds the settings
that are its own, each the run-config key `pruning.<option>` (its defaults, a comment on
each, `validate()` raising OptionError, and, for a policy that runs the client's decoder
layers, `validate_for_client(client_layers)`); `budget` names the option that sets how many
patches it keeps, the one a sweep varies. The settings every QPriv-VL scorer shares (the
fusion weights, the artefacts folder, the encoders) reach it through `PolicyContext`.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from registry import OptionError, Registry, check_names_an_option
from vqa import VQASample


@dataclass(frozen=True)
class Selection:
    """A batch's choice: per-sample ascending keep indices (LongTensor [k_b]) and the
    sensitivity map [B, N] of a policy that scores patches (None for one that does not)."""

    keep: list[torch.Tensor]
    sensitivity: torch.Tensor | None = None
    # A merging policy's per-sample weights [k_b, N]: row j makes the token sent at keep[j] as a
    # mix of the sample's patch rows. None: every kept row is sent as it is.
    mixing: list[torch.Tensor] | None = None

    def rows(self, grid: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, the rows sent from `grid` [B, N, D] (the features the selector saw)."""
        if self.mixing is None:
            return [grid[i, indices] for i, indices in enumerate(self.keep)]
        return [weights.to(grid.device, grid.dtype) @ grid[i] for i, weights in enumerate(self.mixing)]

    def sent_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """`grid` with each kept position holding the row sent there, so that `grid[b, keep[b]]`
        reads what is sent (the grid itself when nothing is merged)."""
        if self.mixing is None:
            return grid
        sent = grid.clone()
        for i, (indices, rows) in enumerate(zip(self.keep, self.rows(grid), strict=True)):
            sent[i, indices.to(grid.device)] = rows
        return sent

    def sources(self) -> list[torch.Tensor]:
        """Per sample, the ascending patches whose content is in some sent row: the kept ones,
        and those a merging policy mixed into them."""
        if self.mixing is None:
            return list(self.keep)
        return [weights.ne(0).any(0).nonzero().squeeze(1) for weights in self.mixing]


class VisualTokenSelector(Protocol):
    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        """features [B, N, Dv] of `samples` -> what to keep of each."""


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may need to build its selector (plain values: pruning does not read run configs).

    `options` are the policy's own (its `Options`; None: the defaults); `tokenizer` is the
    decoder's (random text towers read its vocabulary); `samples` are all the samples the
    selector will see, whose frozen inputs are encoded up front and kept at `cache_path`
    when given; `random_encoders` asks for seeded random encoders even where the profile
    names real checkpoints. `model` is the client's own VLM and `instruction` its prompt's
    (vqa.build_prompt), for the policies that rank with the decoder's attention; `client_layers`
    the decoder layers the client runs before the first cut (None: all of them); `pixel_values`
    the model's preprocessing of samples' images, for those that rank inside the vision tower.
    """

    profile: str
    options: Any = None
    alpha: float = 1.0
    beta: float = 1.0
    seed: int = 0
    artifacts: Path | None = None
    random_encoders: bool = False
    text_source: str | None = None
    dino_source: str | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    samples: Sequence[VQASample] = ()
    cache_path: Path | None = None
    device: str | torch.device = "cpu"
    model: nn.Module | None = None
    instruction: str | None = None
    client_layers: int | None = None
    pixel_values: Callable[[Sequence[VQASample]], torch.Tensor] | None = None


@dataclass
class NoOptions:
    """A policy with no settings of its own."""

    def validate(self) -> None:
        pass


@dataclass
class RatioOptions:
    """The options of a policy that prunes the same share of every sample's patches, keeping
    k = max(k_min, round((1 − ratio)·N)); policies sharing this budget share its run-config key,
    so a sweep sets them to equal token counts with one value."""

    # The share of each sample's patches pruned (QPriv-VL's grid: 0.3, 0.5, 0.7, 0.9).
    ratio: float = 0.0

    def validate(self) -> None:
        if not 0 <= self.ratio < 1:
            raise OptionError("ratio", self.ratio, "a share in [0, 1)")


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: how to build it, its own options, the option that sets how many
    patches it keeps (None: it decides per sample, or keeps all), which artefact file (in
    `pruning.artifacts`) it requires, if any, and whether it merges patch rows (`Selection.mixing`:
    the vision edge's defenses, which send their own tokens by position, cannot follow it)."""

    name: str
    build: Callable[[PolicyContext], VisualTokenSelector]
    Options: type = NoOptions
    budget: str | None = None
    required_artifact: str | None = None
    merges: bool = False


POLICIES: Registry[PolicySpec] = Registry(
    "pruning policy", check=lambda policy: check_names_an_option("pruning policy", policy, "budget"))
register_policy, get_policy, policy_names = POLICIES.register, POLICIES.get, POLICIES.names


def policy_options(policy: PolicySpec, settings: Mapping[str, Any]) -> Any:
    """The policy's Options from the shared pruning settings (`pruning.<key>` without the prefix):
    those it declares; the others are not its own."""
    declared = {f.name for f in fields(policy.Options)}
    return replace(policy.Options(), **{key: value for key, value in settings.items() if key in declared})


def build_policy(name: str, context: PolicyContext) -> VisualTokenSelector:
    """The selector of policy `name`; its options checked first."""
    policy = get_policy(name)
    options = policy.Options() if context.options is None else context.options
    if not isinstance(options, policy.Options):
        raise TypeError(f"pruning policy {name!r} takes {policy.Options.__name__}, not {type(options).__name__}")
    options.validate()
    return policy.build(replace(context, options=options))
