"""Policy "visionzip": dominant tokens by the vision tower's CLS attention, plus merged
contextual tokens (Yang et al. 2025, "VisionZip: Longer is Better but Not Necessary in
Vision Language Models").

At the vision layer whose output LLaVA reads, VisionZip keeps the patches the CLS row
attends to most (summed over heads): the dominant tokens. Of the rest it takes evenly spaced
targets (every ⌊R/c⌋-th of the R remaining, in patch order), assigns each other remaining patch
to the target whose key it is most cosine-similar to, and sends each target's row plus the mean
of the rows assigned to it: the contextual tokens. At LLaVA-1.5's 64 tokens it keeps 54
dominant and 10 contextual; `contextual_share` keeps that proportion at every budget.

VisionZip appends its contextual tokens after the dominant ones; here each stands at its
target's position, so the kept tokens stay in patch order as every policy's do. Merged rows
carry the content of every patch mixed into them, so the pruning record counts those patches
as crossing (`Selection.sources`), not as removed. The vision tower is frozen and public: a
sample's selection is the same in every round and for anyone who holds the public weights.
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
from vlm.segments import FeatureLayerAttention, feature_layer_attention
from vqa import VQASample


@dataclass
class VisionZipOptions(RatioOptions):
    # The share of the kept tokens that are merged contextual tokens (VisionZip's LLaVA-1.5
    # settings: 10 of 64, 20 of 128, 30 of 192); at least one token is always dominant.
    contextual_share: float = 10 / 64

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.contextual_share < 1:
            raise OptionError("contextual_share", self.contextual_share, "a share in [0, 1)")


def visionzip_mixing(cls: torch.Tensor, keys: torch.Tensor, count: int, contextual_share: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's kept indices (ascending) and mixing weights [count, N] from its CLS attention
    [N] and keys [N, Dh]: identity rows for the dominant tokens, target + mean of its assigned
    rows for the contextual ones."""
    patches = cls.shape[0]
    contextual = min(round(count * contextual_share), count - 1)
    dominant = cls.topk(count - contextual).indices
    weights = torch.zeros(patches, patches, dtype=torch.float32, device=cls.device)
    weights[dominant, dominant] = 1.0
    kept = [dominant]
    if contextual > 0:
        remaining = torch.ones(patches, dtype=torch.bool, device=cls.device)
        remaining[dominant] = False
        remaining = remaining.nonzero().squeeze(1)
        step = len(remaining) // contextual
        is_target = torch.zeros(len(remaining), dtype=torch.bool, device=cls.device)
        is_target[torch.arange(0, len(remaining), step, device=cls.device)[:contextual]] = True
        targets, merged = remaining[is_target], remaining[~is_target]
        unit = F.normalize(keys.float(), dim=-1)
        weights[targets, targets] = 1.0
        if len(merged):
            assigned = targets[(unit[merged] @ unit[targets].T).argmax(1)]
            counts = torch.zeros(patches, device=cls.device).index_add_(0, assigned, torch.ones(len(merged), device=cls.device))
            weights[assigned, merged] = 1.0 / counts[assigned]
        kept.append(targets)
    keep = torch.cat(kept).sort().values
    return keep, weights[keep]


class VisionZipSelector:
    def __init__(self, model: torch.nn.Module, pixel_values, ratio: float, contextual_share: float, k_min: int) -> None:
        self.model, self.pixel_values = model, pixel_values
        self.ratio, self.contextual_share, self.k_min = ratio, contextual_share, k_min

    @torch.no_grad()
    def attention(self, samples: Sequence[VQASample]) -> FeatureLayerAttention:
        parameter = next(self.model.parameters())
        pixels = self.pixel_values(samples).to(parameter.device, parameter.dtype)
        return feature_layer_attention(self.model, pixels)

    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        count = keep_count(self.ratio, features.shape[1], self.k_min)
        read = self.attention(samples)
        if read.cls.shape[1] != features.shape[1]:
            raise ValueError(f"the vision tower reads {read.cls.shape[1]} patches but the features hold {features.shape[1]}")
        picked = [visionzip_mixing(cls, keys, count, self.contextual_share) for cls, keys in zip(read.cls, read.keys)]
        return Selection([keep.to(features.device) for keep, _ in picked],
                         mixing=[weights.to(features.device) for _, weights in picked])


def _build_visionzip(context: PolicyContext) -> VisualTokenSelector:
    if context.model is None or context.pixel_values is None:
        raise ValueError("pruning policy 'visionzip' ranks with the vision tower's attention: it needs the model "
                         "and its image preprocessing (PolicyContext.model, .pixel_values)")
    options = context.options
    return VisionZipSelector(context.model, context.pixel_values, options.ratio, options.contextual_share,
                             get_pruning_profile(context.profile).k_min)


register_policy(PolicySpec("visionzip", _build_visionzip, VisionZipOptions, budget="ratio", merges=True))
