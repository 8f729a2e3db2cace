"""Policy "random": each sample keeps a seeded random set of its budget's patches.

The token-pruning literature's strong baseline (DART and UniPruneBench report it close to
the attention-ranked pruners on LLaVA-1.5); here it is the reference a privacy-aware ranker
must beat at equal tokens. The set is a function of the seed and the sample's id, so a
question keeps the same patches in every round, on every client and in every replay.
"""

import random
from collections.abc import Sequence

import torch

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
from vqa import VQASample


def random_keep(sample_id: str, num_patches: int, count: int, seed: int) -> list[int]:
    """`count` of `num_patches` patch indices drawn without replacement, seeded by (seed, sample id), ascending."""
    return sorted(random.Random(f"{seed}:{sample_id}").sample(range(num_patches), count))


class RandomKeep:
    def __init__(self, ratio: float, k_min: int, seed: int) -> None:
        self.ratio, self.k_min, self.seed = ratio, k_min, seed

    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        num_patches = features.shape[1]
        count = keep_count(self.ratio, num_patches, self.k_min)
        return Selection([
            torch.tensor(random_keep(sample.id, num_patches, count, self.seed), device=features.device)
            for sample in samples
        ])


def _build_random(context: PolicyContext) -> VisualTokenSelector:
    return RandomKeep(context.options.ratio, get_pruning_profile(context.profile).k_min, context.seed)


register_policy(PolicySpec("random", _build_random, RatioOptions, budget="ratio"))
