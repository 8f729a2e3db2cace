"""Policy "dart": pivots by L1 norm, then per pivot the least cosine-similar tokens (DART's rule)."""

import pytest
import torch

from pruning import build_policy, get_policy, get_pruning_profile, keep_count, policy_options
from pruning.policies import PolicyContext
from pruning.policies.dart import dart_keep
from registry import OptionError


def test_one_pivot_keeps_the_tokens_least_like_it_not_its_duplicates():
    features = torch.tensor([
        [10.0, 0.0],   # the largest L1 norm: the pivot
        [5.0, 0.1],    # near-duplicates of the pivot, the next largest norms
        [4.0, -0.1],
        [0.2, 3.0],    # almost orthogonal (cosine 0.07)
        [-2.0, 0.5],   # opposite (cosine -0.97)
        [1.0, 1.0],    # cosine 0.71
    ])
    assert dart_keep(features, count=3, pivots=1).tolist() == [0, 3, 4]
    # A norm ranking would have kept the pivot and its duplicates.
    assert features.abs().sum(-1).topk(3).indices.sort().values.tolist() == [0, 1, 2]


def test_pivots_share_the_picks_the_larger_norm_taking_the_remainder():
    features = torch.tensor([
        [10.0, 0.0, 0.0],   # pivot 1 (L1 10)
        [0.0, 9.0, 0.0],    # pivot 2 (L1 9)
        [0.0, 0.0, 1.0],    # a: cosine 0 to pivot 1
        [-1.0, 0.0, 0.1],   # b: cosine -0.995 to pivot 1
        [0.05, -1.0, 0.1],  # c: cosine 0.05 to pivot 1, -0.99 to pivot 2
        [1.0, 1.0, 0.0],    # d: cosine 0.71 to both
        [0.5, -0.2, -1.0],  # e: cosine 0.44 to pivot 1, -0.18 to pivot 2
    ])
    # Five kept: the two pivots, pivot 1's two picks (b, a), pivot 2's one (c); had pivot 2 taken
    # the remainder, it would have kept e (index 6) instead of a.
    assert dart_keep(features, count=5, pivots=2).tolist() == [0, 1, 2, 3, 4]
    # A pick is never made twice: with one pick each, pivot 2 still finds c.
    assert dart_keep(features, count=4, pivots=2).tolist() == [0, 1, 3, 4]


def test_a_budget_below_the_pivot_count_keeps_the_largest_norms():
    features = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.5, 0.5]])
    assert dart_keep(features, count=2, pivots=4).tolist() == [1, 2]


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7, 0.9, 0.95])
def test_the_policy_keeps_exactly_its_budget(ratio, samples):
    profile = get_pruning_profile("mini")
    options = policy_options(get_policy("dart"), {"ratio": ratio})
    selector = build_policy("dart", PolicyContext(profile="mini", options=options))
    features = torch.randn(3, profile.num_patches, 8, generator=torch.Generator().manual_seed(0))
    keep = selector(features, samples[:3]).keep
    assert {len(indices) for indices in keep} == {keep_count(ratio, profile.num_patches, profile.k_min)}
    assert all(torch.equal(indices, indices.unique(sorted=True)) for indices in keep)


def test_a_pivot_count_below_one_is_refused():
    with pytest.raises(OptionError, match="pivots"):
        policy_options(get_policy("dart"), {"pivots": 0}).validate()
