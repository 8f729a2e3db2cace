"""The seam between the frozen vision features and the projector, on the client.

A selector returns, per sample, the indices of the visual tokens to keep. The indices
stay on the client: only the projected kept tokens, after the head's decoder layers,
ever cross a cut. QPriv-VL's policies (fixed ratio, DTP) plug in here.
"""

from collections.abc import Sequence
from typing import Protocol

import torch

from sims.schema import SimConfig


class VisualTokenSelector(Protocol):
    def __call__(self, features: torch.Tensor, questions: Sequence[str]) -> list[torch.Tensor]:
        """features [B, N, Dv] -> per-sample ascending keep indices (LongTensor [k_b])."""


class KeepAll:
    """Policy "off": the undefended baseline keeps every patch."""

    def __call__(self, features: torch.Tensor, questions: Sequence[str]) -> list[torch.Tensor]:
        keep = torch.arange(features.shape[1], device=features.device)
        return [keep for _ in range(features.shape[0])]


def build_selector(config: SimConfig) -> VisualTokenSelector:
    # sims.schema refuses the policies that are not implemented, before anything loads.
    if config.pruning.policy == "off":
        return KeepAll()
    raise ValueError(f"pruning.policy={config.pruning.policy!r} has no selector")
