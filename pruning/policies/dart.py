"""Policy "dart": DART's duplication-aware selection (Wen et al. 2025, "Stop Looking for
Important Tokens in Multimodal Language Models: Duplication Matters More").

DART keeps a few pivot tokens, those whose keys have the largest L1 norm, then, pivot by
pivot, the not yet kept tokens least cosine-similar to that pivot, so the near-duplicates of
what is already kept are what goes. The paper runs it inside the decoder (keys and states
after its second layer, with pivots from the question's text tokens too). Every policy of
this system runs on the client before the projector, where no decoder layer has run and the
question is not in the features' space, so here the vision features serve as keys and
states and every pivot is an image token. The budget is exact: the k − p picks are shared
among the p pivots, the higher-norm pivots taking the remainder.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pruning.module import keep_count
from pruning.policies.base import (
    PolicyContext,
    PolicySpec,
    RatioOptions,
    Selection,
    VisualTokenSelector,
    register_policy,
)
from pruning.profiles import get_pruning_profile
from registry import OptionError
from vqa import VQASample


@dataclass
class DartOptions(RatioOptions):
    # DART's image pivots (its LLaVA-1.5 setting: 4 of 576 tokens, with 4 text pivots that have
    # no counterpart before the projector); never more than a sample's budget.
    pivots: int = 4

    def validate(self) -> None:
        super().validate()
        if self.pivots < 1:
            raise OptionError("pivots", self.pivots, "an integer ≥ 1")


def dart_keep(features: torch.Tensor, count: int, pivots: int) -> torch.Tensor:
    """One sample's `count` kept indices (ascending) of its [N, D] features."""
    pivot_indices = features.abs().sum(dim=-1).topk(min(pivots, count)).indices
    unit = F.normalize(features, dim=-1)
    available = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)
    available[pivot_indices] = False
    picks, extra = divmod(count - len(pivot_indices), len(pivot_indices))
    kept = [pivot_indices]
    for order, pivot in enumerate(pivot_indices):
        take = picks + (order < extra)
        if not take:
            continue
        pool = available.nonzero().squeeze(1)
        similarity = unit[pool] @ unit[pivot]
        chosen = pool[similarity.topk(take, largest=False).indices]
        available[chosen] = False
        kept.append(chosen)
    return torch.cat(kept).sort().values


class DartSelector:
    def __init__(self, ratio: float, pivots: int, k_min: int) -> None:
        self.ratio, self.pivots, self.k_min = ratio, pivots, k_min

    @torch.no_grad()
    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        count = keep_count(self.ratio, features.shape[1], self.k_min)
        return Selection([dart_keep(row.float(), count, self.pivots) for row in features])


def _build_dart(context: PolicyContext) -> VisualTokenSelector:
    options = context.options
    return DartSelector(options.ratio, options.pivots, get_pruning_profile(context.profile).k_min)


register_policy(PolicySpec("dart", _build_dart, DartOptions, budget="ratio"))
