"""The statistics every verdict uses: paired comparisons with a bootstrap interval over seeds and
questions, judged against a declared margin.

    reference = outcomes(results.outcomes, policy="off", paradigm="usl")
    pruned = outcomes(results.outcomes, policy="dtp", paradigm="usl")
    judgement = compare(reference, pruned, Rule(margin=-0.05, direction=ABOVE, claim="DTP within 5 points"))
    judgement.verdict  # holds, does not hold, inconclusive or not testable, with its reason and n

An `Outcomes` is every seed of one setting: per seed, per item (a test question, an attacked sample,
or the run as one item where an attack reports only a number), a score. It can only be built from
all the runs a setting has — `outcomes` refuses a filter on the seed or the run, and more than one
run per seed — so a comparison cannot be made on the best of several runs. Two settings compared
must hold the same seeds and, per seed, the same items, and come from the same start of their
sweep (a reference run at another commit is not the point's reference): the difference is taken
item by item.

The interval is a percentile bootstrap of the mean difference that resamples seeds, then items
within each drawn seed (a nested bootstrap, so the run-to-run spread and the question sampling both
widen it). A verdict needs MIN_SEEDS seeds: below that a percentile interval is only the range of
the draws, and one seed hides the run-to-run spread that moved a rebuilt point by 7 points.

A rule says on which side of its margin the estimate must lie: holds when the whole interval is on
that side, does not hold when the whole interval is on the other, inconclusive when it straddles
the margin. An equivalence rule (WITHIN) holds when the whole interval lies inside ±margin and does
not hold when it lies wholly outside. A comparison of an attack's success also names the attack's floor (what it reaches by
recovering nothing: the mean image's PSNR, AUC 0.5, the majority answer's share); when the
reference's interval is not clear of the floor the attack had nothing to lose, and the claim is
not testable there.
"""

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import rankdata
from sklearn.metrics import roc_auc_score

RESAMPLES = 2000
LEVEL = 0.95
MIN_SEEDS = 3
# Columns that pick one run of a setting, which a setting's outcomes never filter on.
RUN_COLUMNS = frozenset({"seed", "run", "folder"})
ABOVE = "above"
BELOW = "below"
WITHIN = "within"


def sample_size(seeds: int, items: int) -> str:
    """n as every verdict shows it: "3 seeds × 200 items"."""
    return f"{seeds} seed{'s' if seeds != 1 else ''} × {items} item{'s' if items != 1 else ''}"


class Verdict(str, Enum):
    HOLDS = "holds"
    DOES_NOT_HOLD = "does not hold"
    INCONCLUSIVE = "inconclusive"
    NOT_TESTABLE = "not testable"

    def __str__(self) -> str:
        return self.value


class UnpairedError(ValueError):
    """Two settings' outcomes that cannot be compared item by item."""


@dataclass(frozen=True)
class Outcomes:
    """Every seed of one setting: `scores` has columns seed, item, score (one row per seed and item)."""

    setting: str
    scores: pd.DataFrame
    # The starts (commits) the runs were made by: a reference from another start is not paired.
    starts: frozenset[str] = frozenset()

    @property
    def seeds(self) -> list[int]:
        return sorted(self.scores["seed"].unique().tolist())

    @property
    def items(self) -> int:
        """Items per seed (the smallest, where seeds hold different ones)."""
        return int(self.scores.groupby("seed")["item"].nunique().min()) if not self.scores.empty else 0

    def n(self) -> str:
        return sample_size(len(self.seeds), self.items)

    def at(self, seeds: Iterable[int]) -> "Outcomes":
        """These outcomes at `seeds` only."""
        return Outcomes(self.setting, self.scores[self.scores["seed"].isin(list(seeds))].reset_index(drop=True),
                        self.starts)

    def matrix(self) -> list[tuple[int, np.ndarray, list[Any]]]:
        """(seed, scores, items) per seed, items sorted."""
        rows = []
        for seed, group in self.scores.sort_values(["seed", "item"]).groupby("seed", sort=True):
            rows.append((int(seed), group["score"].to_numpy(dtype=float), group["item"].tolist()))
        return rows


def outcomes(frame: pd.DataFrame, metric: str = "score", label: str | None = None, **setting: Any) -> Outcomes:
    """The outcomes of the setting `setting` (column → value) from `frame` (one row per run, seed and
    item, with columns seed, item and `metric`): every seed it ran at. Refuses a filter on the seed or
    the run, and a setting that matches two runs at one seed (name the column that tells them apart)."""
    chosen_by = sorted(set(setting) & RUN_COLUMNS)
    if chosen_by:
        raise ValueError(f"a setting's outcomes take every seed it ran at; it cannot be filtered on {chosen_by} "
                         "(choosing runs is choosing the best of N)")
    chosen = frame
    for column, value in setting.items():
        if column not in chosen:
            raise KeyError(f"no column {column!r} to pick the setting by (columns: {sorted(frame.columns)})")
        chosen = chosen[chosen[column].isna()] if _missing(value) else chosen[chosen[column] == value]
    name = label or ", ".join(f"{k}={v}" for k, v in setting.items()) or "all"
    if "run" in chosen and not chosen.empty:
        runs = chosen.groupby("seed")["run"].nunique()
        if (runs > 1).any():
            seed = int(runs[runs > 1].index[0])
            found = sorted(chosen.loc[chosen["seed"] == seed, "run"].unique())
            raise ValueError(f"the setting {name} matches {len(found)} runs at seed {seed} ({', '.join(found[:4])}): "
                             "pin the setting with the column that tells them apart")
    scores = chosen[["seed", "item", metric]].rename(columns={metric: "score"}).dropna(subset=["score"])
    starts = frozenset(str(s) for s in chosen["start"].dropna().unique()) if "start" in chosen else frozenset()
    return Outcomes(name, scores.reset_index(drop=True), starts)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


@dataclass(frozen=True)
class Estimate:
    """A mean (of one setting, or of a paired difference) with its bootstrap interval and its n."""

    value: float
    low: float
    high: float
    seeds: int
    items: int
    level: float = LEVEL

    def show(self, spec: str = ".3f") -> str:
        return f"{self.value:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"

    @property
    def n(self) -> str:
        return sample_size(self.seeds, self.items)


def _seed_means(per_seed: list[np.ndarray], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """(seeds, resamples): each seed's mean over a bootstrap draw of its items."""
    means = np.empty((len(per_seed), resamples))
    for index, values in enumerate(per_seed):
        draws = rng.integers(0, len(values), size=(resamples, len(values)))
        means[index] = values[draws].mean(axis=1)
    return means


def bootstrap(per_seed: list[np.ndarray], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> Estimate:
    """The mean over seeds of each seed's mean, with a nested percentile bootstrap interval: seeds
    drawn with replacement, then each drawn seed's items (a seed drawn twice gets two item draws)."""
    if not per_seed or any(len(values) == 0 for values in per_seed):
        raise ValueError("a bootstrap needs at least one seed with at least one item")
    rng = np.random.default_rng(seed)
    means = _seed_means(per_seed, rng, resamples)
    count = len(per_seed)
    chosen = rng.integers(0, count, size=(resamples, count))
    # The j-th draw of a resample reads column (r + j): a seed drawn twice gets two item draws.
    columns = (np.arange(resamples)[:, None] + np.arange(count)[None, :]) % resamples
    statistic = means[chosen, columns].mean(axis=1)
    low, high = np.quantile(statistic, [(1 - level) / 2, (1 + level) / 2])
    value = float(np.mean([values.mean() for values in per_seed]))
    return Estimate(value, float(low), float(high), count, min(len(values) for values in per_seed), level)


def difference(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    return second - first


def wilson(successes: float, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval of a share (`successes` of `n`): where a share of one sample is
    reported on its own (a target's accuracy, a probe's), not compared."""
    if n == 0:
        return (math.nan, math.nan)
    z = NormalDist().inv_cdf((1 + level) / 2)
    p = successes / n
    denominator = 1 + z**2 / n
    centre = (p + z**2 / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def rank_auroc(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The AUROC of each row of `scores` against its row of 0/1 `labels`, by the Mann–Whitney U
    statistic on average ranks (a tie counts half, as in sklearn's roc_auc_score, which gives the
    same number one row per call); NaN for a row holding one class only."""
    ranks = rankdata(scores, axis=1)
    labels = labels.astype(float)
    positives = labels.sum(axis=1)
    pairs = positives * (labels.shape[1] - positives)
    u = (ranks * labels).sum(axis=1) - positives * (positives + 1) / 2
    return np.divide(u, pairs, out=np.full(len(u), np.nan), where=pairs > 0)


# Elements of one batch of resampled rows that rank_auroc ranks at once (about 32 MiB of float64).
AUROC_BATCH = 1 << 22


def bootstrap_auroc(scores: np.ndarray, labels: np.ndarray, resamples: int = RESAMPLES, level: float = LEVEL,
                    seed: int = 0) -> Estimate:
    """The AUROC of `scores` against 0/1 `labels`, both [groups, ...] (an image's patches), pooled,
    with a percentile bootstrap over the groups (patches of one image are not independent).
    Resamples that draw one class only are left out."""
    value = float(roc_auc_score(labels.reshape(-1), scores.reshape(-1)))
    rng = np.random.default_rng(seed)
    groups = scores.shape[0]
    picks = rng.integers(groups, size=(resamples, groups))
    per_resample = scores[:1].size * groups
    batches = np.array_split(picks, max(1, resamples * per_resample // AUROC_BATCH))
    draws = np.concatenate([rank_auroc(scores[batch].reshape(len(batch), -1), labels[batch].reshape(len(batch), -1))
                            for batch in batches])
    low, high = np.quantile(draws[~np.isnan(draws)], [(1 - level) / 2, (1 + level) / 2])
    return Estimate(value, float(low), float(high), 1, groups, level)


def paired_differences(first: Outcomes, second: Outcomes,
                       how: Callable[[np.ndarray, np.ndarray], np.ndarray] = difference) -> list[np.ndarray]:
    """Per seed, `how`(first, second) item by item (by default second − first); raises UnpairedError
    naming what differs."""
    if first.starts and second.starts and first.starts != second.starts:
        raise UnpairedError(f"{first.setting} comes from the start(s) {sorted(first.starts)} and {second.setting} from "
                            f"{sorted(second.starts)}: a reference must come from the same start as its point")
    if first.seeds != second.seeds:
        raise UnpairedError(f"{first.setting} ran at seeds {first.seeds} and {second.setting} at {second.seeds}: "
                            "a paired comparison needs the same seeds")
    differences = []
    for (seed, a, items_a), (_, b, items_b) in zip(first.matrix(), second.matrix(), strict=True):
        if items_a != items_b:
            only = sorted(set(map(str, items_a)) ^ set(map(str, items_b)))
            raise UnpairedError(f"at seed {seed} {first.setting} and {second.setting} scored different items "
                                f"({len(only)} not in both, e.g. {only[:3]}): a paired comparison needs the same ones")
        differences.append(how(a, b))
    return differences


@dataclass(frozen=True)
class Floor:
    """What an attack reaches by recovering nothing, and how far above it a reference must be for a
    reduction to be measurable (the reference's whole interval above value + margin)."""

    value: float
    margin: float
    what: str


@dataclass(frozen=True)
class Rule:
    """What a claim asserts of an estimate: that it lies ABOVE or BELOW `margin`, or WITHIN ±`margin`."""

    margin: float
    direction: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.direction not in (ABOVE, BELOW, WITHIN):
            raise ValueError(f"Rule.direction is {self.direction!r}; allowed: {ABOVE!r}, {BELOW!r}, {WITHIN!r}")
        if self.direction == WITHIN and self.margin <= 0:
            raise ValueError(f"Rule.margin is {self.margin!r}; an equivalence margin must be positive")

    def judge(self, estimate: Estimate) -> Verdict:
        low, high = estimate.low, estimate.high
        if self.direction == WITHIN:
            if -self.margin < low and high < self.margin:
                return Verdict.HOLDS
            if low > self.margin or high < -self.margin:
                return Verdict.DOES_NOT_HOLD
            return Verdict.INCONCLUSIVE
        if self.direction == BELOW:
            low, high = high, low
        sign = 1 if self.direction == ABOVE else -1
        if sign * (low - self.margin) > 0:
            return Verdict.HOLDS
        if sign * (high - self.margin) < 0:
            return Verdict.DOES_NOT_HOLD
        return Verdict.INCONCLUSIVE

    def describe(self) -> str:
        if self.text:
            return self.text
        return {ABOVE: f"interval above {self.margin:g}", BELOW: f"interval below {self.margin:g}",
                WITHIN: f"interval within ±{self.margin:g}"}[self.direction]


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str
    estimate: Estimate | None = None
    rule: Rule | None = None
    n: str = ""


def not_testable(reason: str, n: str = "") -> Judgement:
    return Judgement(Verdict.NOT_TESTABLE, reason, n=n)


def _too_few(parts: Iterable[Outcomes], value: Estimate, rule: Rule) -> Judgement | None:
    """Not testable below MIN_SEEDS seeds; the estimate is kept (its interval is over the items only)."""
    for part in parts:
        if len(part.seeds) < MIN_SEEDS:
            return Judgement(Verdict.NOT_TESTABLE, f"{part.setting} ran at {len(part.seeds)} seed(s); a verdict needs "
                             f"at least {MIN_SEEDS} (the interval shown is over the items only)", value, rule, part.n())
    return None


def floor_check(reference: Outcomes, floor: Floor | None, resamples: int = RESAMPLES, seed: int = 0) -> Judgement | None:
    """Not testable (a Judgement saying so) when `reference`'s interval is not clear of `floor`; else None."""
    if floor is None:
        return None
    level = bootstrap([values for _, values, _ in reference.matrix()], resamples, seed=seed)
    if level.low <= floor.value + floor.margin:
        return Judgement(Verdict.NOT_TESTABLE,
                         f"the attack sits at its floor on {reference.setting}: {level.show('.3g')} against "
                         f"{floor.what} {floor.value:.3g} (needs its interval above {floor.value + floor.margin:.3g})",
                         estimate=level, n=reference.n())
    return None


def estimate(part: Outcomes, rule: Rule, floor: Floor | None = None, resamples: int = RESAMPLES,
             seed: int = 0) -> Judgement:
    """One setting's mean judged by `rule` (e.g. an exclusion ratio above 1)."""
    if part.scores.empty:
        return not_testable(f"no outcomes for {part.setting}")
    value = bootstrap([values for _, values, _ in part.matrix()], resamples, seed=seed)
    early = _too_few([part], value, rule) or floor_check(part, floor, resamples, seed)
    if early is not None:
        return early
    return Judgement(rule.judge(value), rule.describe(), value, rule, part.n())


def compare(reference: Outcomes, other: Outcomes, rule: Rule, floor: Floor | None = None,
            how: Callable[[np.ndarray, np.ndarray], np.ndarray] = difference, resamples: int = RESAMPLES,
            seed: int = 0) -> Judgement:
    """`other` − `reference` (or `how`(reference, other): a share, a ratio), item by item within each
    seed, on the seeds both ran, judged by `rule`. Not testable with fewer than MIN_SEEDS common
    seeds, when the reference sits at `floor`, or when the two hold different items or come from
    different starts (the reason says which)."""
    for part in (reference, other):
        if part.scores.empty:
            return not_testable(f"no outcomes for {part.setting}")
    # Paired on the seeds both settings ran (which seeds ran is not chosen by their outcomes).
    common = sorted(set(reference.seeds) & set(other.seeds))
    if not common:
        return not_testable(f"{reference.setting} ran at seeds {reference.seeds} and {other.setting} at {other.seeds}: "
                            "no seed in common to pair")
    reference, other = reference.at(common), other.at(common)
    try:
        differences = paired_differences(reference, other, how)
    except UnpairedError as error:
        return not_testable(f"unpaired: {error}")
    value = bootstrap(differences, resamples, seed=seed)
    early = _too_few([reference, other], value, rule)
    if early is not None:
        return early
    at_floor = floor_check(reference, floor, resamples, seed)
    if at_floor is not None:
        # The row still shows the difference it is labelled with; the reason gives the reference's level.
        return replace(at_floor, estimate=value, n=reference.n())
    return Judgement(rule.judge(value), rule.describe(), value, rule, reference.n())
