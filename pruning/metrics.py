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
from collections.abc import Mapping, Sequence
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


# Keys of a PruningRecord in a client's reply (Flower metric records hold numbers and lists).
RECORD_PREFIX = "pruning."


@dataclass(frozen=True)
class PruningRecord:
    """What pruning did to some samples, per sample; records of many batches, messages
    and clients concatenate (`merge`) and summarise once per round.

    On a stamped benchmark `mark_patches` counts the patches that hold a sample's mark
    and `mark_patches_removed` those of them that were pruned: removing the mark more
    often than patches in general (`mark_patches_removed_share` > `patches_removed_share`)
    is what a privacy-aware policy should do. Only these sums leave the client, never
    the keep indices.
    """

    num_patches: int
    kept_tokens: tuple[int, ...] = ()
    # Defined ratios only; `exclusion_undefined` counts the samples where nothing was pruned.
    exclusion_ratios: tuple[float, ...] = ()
    exclusion_undefined: int = 0
    mark_patches: int = 0
    mark_patches_removed: int = 0

    @classmethod
    def of_batch(
        cls,
        keep: Sequence[torch.Tensor],
        num_patches: int,
        *,
        sensitivity: torch.Tensor | None = None,
        marks: Sequence[Sequence[int]] = (),
        sources: Sequence[torch.Tensor] | None = None,
    ) -> "PruningRecord":
        """`keep`: per-sample indices; `sensitivity` [B, N] if the policy scores patches;
        `marks`: per sample, the patches holding its mark (empty when unstamped); `sources`: per
        sample, the patches whose content is sent (Selection.sources; None: the kept ones), so a
        mark patch merged into a kept token counts as sent, not removed."""
        ratios = sensitivity_exclusion_ratios(sensitivity, keep) if sensitivity is not None else []
        mark_total = mark_removed = 0
        for indices, mark in zip(keep if sources is None else sources, marks, strict=False):
            kept = set(indices.tolist())
            mark_total += len(mark)
            mark_removed += sum(patch not in kept for patch in mark)
        return cls(
            num_patches=num_patches,
            kept_tokens=tuple(int(indices.numel()) for indices in keep),
            exclusion_ratios=tuple(ratio for ratio in ratios if not math.isnan(ratio)),
            exclusion_undefined=sum(math.isnan(ratio) for ratio in ratios),
            mark_patches=mark_total,
            mark_patches_removed=mark_removed,
        )

    def merge(self, other: "PruningRecord") -> "PruningRecord":
        if other.num_patches != self.num_patches:
            raise ValueError(f"cannot merge pruning records over {self.num_patches} and {other.num_patches} patches")
        return PruningRecord(
            num_patches=self.num_patches,
            kept_tokens=self.kept_tokens + other.kept_tokens,
            exclusion_ratios=self.exclusion_ratios + other.exclusion_ratios,
            exclusion_undefined=self.exclusion_undefined + other.exclusion_undefined,
            mark_patches=self.mark_patches + other.mark_patches,
            mark_patches_removed=self.mark_patches_removed + other.mark_patches_removed,
        )

    def as_message_metrics(self) -> dict[str, int | list[int] | list[float]]:
        return {
            f"{RECORD_PREFIX}num_patches": self.num_patches,
            f"{RECORD_PREFIX}kept_tokens": list(self.kept_tokens),
            f"{RECORD_PREFIX}exclusion_ratios": list(self.exclusion_ratios),
            f"{RECORD_PREFIX}exclusion_undefined": self.exclusion_undefined,
            f"{RECORD_PREFIX}mark_patches": self.mark_patches,
            f"{RECORD_PREFIX}mark_patches_removed": self.mark_patches_removed,
        }

    @classmethod
    def from_message_metrics(cls, metrics: Mapping[str, object]) -> "PruningRecord":
        """The record in a client's reply; a missing or malformed entry names the key."""
        values = {}
        for field_name, kind in (
            ("num_patches", int),
            ("kept_tokens", list),
            ("exclusion_ratios", list),
            ("exclusion_undefined", int),
            ("mark_patches", int),
            ("mark_patches_removed", int),
        ):
            key = f"{RECORD_PREFIX}{field_name}"
            if key not in metrics:
                raise KeyError(f"the reply's metrics lack {key!r}")
            value = metrics[key]
            if kind is int:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
                    raise ValueError(f"reply metric {key}={value!r} is not a count")
                values[field_name] = int(value)
            else:
                if not isinstance(value, list):
                    raise ValueError(f"reply metric {key}={value!r} is not a list")
                values[field_name] = tuple(value)
        kept = values["kept_tokens"]
        if any(not 0 < count <= values["num_patches"] for count in kept):
            raise ValueError(f"reply metric {RECORD_PREFIX}kept_tokens has counts outside [1, {values['num_patches']}]")
        return cls(**values)

    def as_round_metrics(self) -> dict[str, float | None]:
        """The per-round record: keep-count distribution, exclusion ratio, removal shares."""
        if not self.kept_tokens:
            return {}
        removed = len(self.kept_tokens) * self.num_patches - sum(self.kept_tokens)
        metrics: dict[str, float | None] = dict(summarize_keep_counts(self.kept_tokens, self.num_patches).as_metrics())
        exclusion = summarize_exclusion([*self.exclusion_ratios, *[math.nan] * self.exclusion_undefined])
        metrics |= {
            key: (None if math.isnan(value) else value) for key, value in exclusion.as_metrics().items()
        }
        metrics["patches_removed_share"] = removed / (len(self.kept_tokens) * self.num_patches)
        metrics["mark_patches_removed_share"] = (
            self.mark_patches_removed / self.mark_patches if self.mark_patches else None
        )
        return metrics
