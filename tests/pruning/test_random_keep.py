"""Policy "random": a seeded draw per sample, of exactly the budget's size."""

from collections import Counter
from dataclasses import replace

import torch

from pruning import RatioOptions, build_policy, get_pruning_profile, keep_count
from pruning.policies.random_keep import random_keep
from pruning.policies import PolicyContext


def selector(ratio: float, seed: int = 0):
    return build_policy("random", PolicyContext(profile="mini", options=RatioOptions(ratio), seed=seed))


def test_a_sample_keeps_the_same_patches_in_any_batch_and_the_budget_sets_how_many(samples):
    profile = get_pruning_profile("mini")
    features = torch.zeros(len(samples), profile.num_patches, 4)
    whole = selector(0.75)(features, samples).keep
    alone = selector(0.75)(features[:1], samples[:1]).keep
    reversed_batch = selector(0.75)(features, samples[::-1]).keep[::-1]
    assert torch.equal(whole[0], alone[0])
    assert all(torch.equal(a, b) for a, b in zip(whole, reversed_batch, strict=True))
    assert {len(indices) for indices in whole} == {keep_count(0.75, profile.num_patches, profile.k_min)}
    assert all(torch.equal(indices, indices.unique(sorted=True)) for indices in whole)


def test_the_features_do_not_matter_the_seed_and_the_sample_do(samples):
    profile = get_pruning_profile("mini")
    zeros, noise = torch.zeros(2, profile.num_patches, 4), torch.randn(2, profile.num_patches, 4)
    first, second = samples[:2]
    assert torch.equal(selector(0.5)(zeros, [first, second]).keep[0], selector(0.5)(noise, [first, second]).keep[0])
    assert not torch.equal(selector(0.5)(zeros, [first]).keep[0], selector(0.5, seed=1)(zeros, [first]).keep[0])
    other = replace(first, id="another-question")
    assert not torch.equal(selector(0.5)(zeros, [first]).keep[0], selector(0.5)(zeros, [other]).keep[0])


def test_every_patch_is_as_likely_to_be_kept():
    # 2,000 draws of 16 of 64: each patch expects 500; a draw favouring some patches would leave this band.
    counts = Counter(index for draw in range(2000) for index in random_keep(f"q{draw}", 64, 16, seed=0))
    assert set(counts) == set(range(64))
    assert 400 < min(counts.values()) and max(counts.values()) < 600
