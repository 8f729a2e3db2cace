"""Exclusion ratio and keep-count summaries, including the cases where a ratio is undefined."""

import math

import pytest
import torch

from pruning import (
    sensitivity_exclusion_ratios,
    summarize_exclusion,
    summarize_keep_counts,
)


def test_the_exclusion_ratio_is_pruned_mean_over_kept_mean():
    sensitivity = torch.tensor([[0.9, 0.1, 0.7, 0.3], [0.2, 0.2, 0.8, 0.8]])
    keep = [torch.tensor([1, 3]), torch.tensor([2, 3])]
    ratios = sensitivity_exclusion_ratios(sensitivity, keep)
    assert ratios == pytest.approx([0.8 / 0.2, 0.2 / 0.8])  # sensitive pruned: > 1; sensitive kept: < 1


def test_the_ratio_is_undefined_when_either_group_is_empty():
    sensitivity = torch.tensor([[0.9, 0.1, 0.7], [0.5, 0.4, 0.3]])
    nothing_pruned, nothing_kept = torch.arange(3), torch.tensor([], dtype=torch.long)
    assert all(math.isnan(r) for r in sensitivity_exclusion_ratios(sensitivity, [nothing_pruned, nothing_kept]))


def test_a_keep_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="1 keep-index tensors for 2 sensitivity maps"):
        sensitivity_exclusion_ratios(torch.rand(2, 4), [torch.arange(2)])


def test_the_exclusion_summary_leaves_undefined_samples_out_and_counts_them():
    summary = summarize_exclusion([1.0, math.nan, 1.4, math.nan])
    assert (summary.mean, summary.std, summary.defined, summary.undefined) == pytest.approx((1.2, 0.2, 2, 2))
    assert summary.as_metrics() == {
        "exclusion_ratio_mean": pytest.approx(1.2),
        "exclusion_ratio_std": pytest.approx(0.2),
        "exclusion_ratio_defined": 2.0,
        "exclusion_ratio_undefined": 2.0,
    }
    nothing = summarize_exclusion([math.nan])
    assert math.isnan(nothing.mean) and math.isnan(nothing.std) and nothing.undefined == 1


def test_the_keep_count_summary_describes_the_distribution():
    summary = summarize_keep_counts([16, 32, 32, 48, 64], num_patches=64)
    assert (summary.count, summary.mean, summary.min, summary.median, summary.max) == (5, 38.4, 16, 32, 64)
    assert (summary.q25, summary.q75) == (32, 48)
    assert summary.std == pytest.approx(torch.tensor([16, 32, 32, 48, 64.0]).std(correction=0).item())
    assert summary.mean_share == pytest.approx(0.6)
    assert set(summary.as_metrics("kept")) == {f"kept_{name}" for name in ("count", "mean", "std", "min", "q25", "median", "q75", "max", "mean_share")}
    with pytest.raises(ValueError, match="no keep counts"):
        summarize_keep_counts([], num_patches=64)
