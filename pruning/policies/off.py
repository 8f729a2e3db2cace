"""Policy "off": keep every patch (ρ = 0), the undefended baseline."""

from collections.abc import Sequence

import torch

from pruning.policies.base import PolicyContext, PolicySpec, Selection, VisualTokenSelector, register_policy
from vqa import VQASample


class KeepAll:
    """Every patch, in order."""

    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        keep = torch.arange(features.shape[1], device=features.device)
        return Selection([keep for _ in range(features.shape[0])])


def _build_off(context: PolicyContext) -> VisualTokenSelector:
    return KeepAll()


register_policy(PolicySpec("off", _build_off))
