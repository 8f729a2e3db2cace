"""Exclusion ratio, keep-count summaries (including where a ratio is undefined) and the per-round pruning record."""

import math

import pytest
import torch

from pruning import (
    PruningRecord,
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


def test_a_pruning_record_counts_kept_tokens_exclusion_and_mark_removal():
    sensitivity = torch.tensor([[0.9, 0.1, 0.1, 0.9], [0.5, 0.5, 0.5, 0.5]])
    keep = [torch.tensor([1, 2]), torch.tensor([0, 1, 2, 3])]
    record = PruningRecord.of_batch(keep, 4, sensitivity=sensitivity, marks=[(0, 3), ()])
    assert record.kept_tokens == (2, 4)
    assert record.exclusion_ratios == pytest.approx((9.0,)) and record.exclusion_undefined == 1
    assert (record.mark_patches, record.mark_patches_removed) == (2, 2)
    metrics = record.as_round_metrics()
    assert metrics["kept_tokens_mean"] == 3 and metrics["patches_removed_share"] == 2 / 8
    assert metrics["mark_patches_removed_share"] == 1.0 and metrics["exclusion_ratio_mean"] == pytest.approx(9.0)


def test_pruning_records_merge_and_cross_the_message_boundary_intact():
    first = PruningRecord.of_batch([torch.tensor([0])], 4, marks=[(0, 1)])
    second = PruningRecord.of_batch([torch.tensor([0, 1, 2])], 4)
    merged = first.merge(second)
    assert merged == PruningRecord.from_message_metrics(merged.as_message_metrics())
    assert merged.kept_tokens == (1, 3) and (merged.mark_patches, merged.mark_patches_removed) == (2, 1)
    assert merged.as_round_metrics()["exclusion_ratio_mean"] is None  # no sensitivity map: undefined, not 0
    with pytest.raises(ValueError, match="64 patches"):
        first.merge(PruningRecord(num_patches=64))


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("pruning.kept_tokens", [0], "outside"),
        ("pruning.kept_tokens", [5], "outside"),
        ("pruning.kept_tokens", 3, "not a list"),
        ("pruning.mark_patches", -1, "not a count"),
        ("pruning.mark_patches", 1.5, "not a count"),
    ],
)
def test_a_malformed_pruning_record_from_a_client_is_refused_naming_the_key(key, value, problem):
    metrics = PruningRecord.of_batch([torch.tensor([0, 1])], 4).as_message_metrics() | {key: value}
    with pytest.raises(ValueError, match=problem):
        PruningRecord.from_message_metrics(metrics)
    del metrics[key]
    with pytest.raises(KeyError, match=key):
        PruningRecord.from_message_metrics(metrics)
