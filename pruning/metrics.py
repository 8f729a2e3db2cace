"""What a pruning policy did, as numbers: keep counts and the sensitivity exclusion ratio.

Exclusion ratio (SPEC §1) of one sample = mean sensitivity of its pruned patches /
mean sensitivity of its kept patches; above 1, sensitive patches were preferentially
removed. It compares two groups, so it is undefined — NaN, never a guessed 0 or 1 —
when either is empty: nothing pruned (policy off, or ρ small enough that k = N) or
nothing kept (no policy here does that: k ≥ k_min ≥ 1). Summaries leave undefined
samples out of the mean and report how many there were. A kept mean of exactly 0
(sensitivities are sigmoids, so only by underflow) with a positive pruned mean gives inf.
"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


def sensitivity_exclusion_ratios(sensitivity: torch.Tensor, keep: Sequence[torch.Tensor]) -> list[float]:
    """Per sample: mean of `sensitivity` [B, N] over pruned patches / mean over kept ones (`keep`: indices)."""
    if len(keep) != sensitivity.shape[0]:
        raise ValueError(f"{len(keep)} keep-index tensors for {sensitivity.shape[0]} sensitivity maps")
    ratios = []
    for row, indices in zip(sensitivity.float(), keep, strict=True):
        kept = torch.zeros_like(row, dtype=torch.bool)
        kept[indices.to(row.device)] = True
        if kept.all() or not kept.any():
            ratios.append(math.nan)
        else:
            ratios.append(float(row[~kept].mean() / row[kept].mean()))
    return ratios


def _population_std(values: torch.Tensor) -> float:
    return float(values.std(correction=0)) if values.numel() else math.nan


@dataclass(frozen=True)
class ExclusionSummary:
    """Mean and (population) standard deviation over the samples where the ratio is defined."""

    mean: float
    std: float
    defined: int
    undefined: int

    def as_metrics(self, prefix: str = "exclusion_ratio") -> dict[str, float]:
        return {f"{prefix}_{name}": float(value) for name, value in asdict(self).items()}


def summarize_exclusion(ratios: Sequence[float]) -> ExclusionSummary:
    values = torch.tensor([ratio for ratio in ratios if not math.isnan(ratio)], dtype=torch.float64)
    return ExclusionSummary(
        mean=float(values.mean()) if values.numel() else math.nan,
        std=_population_std(values),
        defined=values.numel(),
        undefined=len(ratios) - values.numel(),
    )


@dataclass(frozen=True)
class KeepCountSummary:
    """The distribution of kept visual tokens per sample; `mean_share` is mean / N."""

    count: int
    mean: float
    std: float
    min: float
    q25: float
    median: float
    q75: float
    max: float
    mean_share: float

    def as_metrics(self, prefix: str = "kept_tokens") -> dict[str, float]:
        return {f"{prefix}_{name}": float(value) for name, value in asdict(self).items()}


def summarize_keep_counts(counts: Sequence[int], num_patches: int) -> KeepCountSummary:
    if not counts:
        raise ValueError("no keep counts to summarise")
    values = torch.tensor(counts, dtype=torch.float64)
    q25, median, q75 = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return KeepCountSummary(
        count=values.numel(),
        mean=float(values.mean()),
        std=_population_std(values),
        min=float(values.min()),
        q25=q25,
        median=median,
        q75=q75,
        max=float(values.max()),
        mean_share=float(values.mean()) / num_patches,
    )
