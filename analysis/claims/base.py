"""What every paper's claims module shares: a claim's row, and the outcomes a claim reads.

A claim's row says what the paper reports, what was measured here with its interval and n, the
rule and margin the verdict applies, the verdict, and why (for "not testable": what is missing).
"""

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from analysis.runs import Results
from analysis.stats import Judgement, Outcomes, Verdict, outcomes

# An image attack recovers nothing when its PSNR is at most this many dB above the mean auxiliary
# image's (baseline_psnr): on flat backgrounds the mean image's SSIM is above nearly every
# reconstruction's, so the gain in PSNR is what tells an image recovered from none.
NOTHING_DB = 1.0
COLUMNS = ["claim", "paper", "measured", "verdict", "estimate", "low", "high", "n", "reason"]


def row(claim: str, paper: str, judgement: Judgement, measured: str = "") -> dict[str, Any]:
    estimate = judgement.estimate
    return {"claim": claim, "paper": paper, "measured": measured, "verdict": str(judgement.verdict),
            "estimate": None if estimate is None else estimate.value, "low": None if estimate is None else estimate.low,
            "high": None if estimate is None else estimate.high, "n": judgement.n, "reason": judgement.reason}


def table(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=COLUMNS)


def accuracy_outcomes(results: Results, label: str | None = None, metric: str = "score", **setting: Any) -> Outcomes:
    """A setting's test outcomes over its honest runs: per question where its runs recorded them
    (outcomes.jsonl), else each run's test accuracy as one item."""
    frame = results.outcomes
    if not frame.empty and "hijacked" in frame:
        frame = frame[~frame["hijacked"].astype(bool)]
    chosen = outcomes(frame, metric, label, **setting) if not frame.empty else None
    if chosen is not None and not chosen.scores.empty:
        return chosen
    runs = results.honest()
    return run_outcomes(runs, "test_accuracy", label, **setting)


def run_outcomes(frame: pd.DataFrame, metric: str, label: str | None = None, **setting: Any) -> Outcomes:
    """A setting's `metric` with each run as one item (an attack's headline, a run's accuracy)."""
    if frame.empty or metric not in frame:
        return Outcomes(label or metric, pd.DataFrame(columns=["seed", "item", "score"]))
    return outcomes(frame.assign(item="run"), metric, label, **setting)


def all_of(judgements: list[Judgement], reason: str) -> Judgement:
    """One verdict for a claim that needs every part: not testable if a part is, does not hold if a
    part does not, inconclusive if a part is, else holds."""
    for verdict in (Verdict.NOT_TESTABLE, Verdict.DOES_NOT_HOLD, Verdict.INCONCLUSIVE):
        failing = [j for j in judgements if j.verdict is verdict]
        if failing:
            return Judgement(verdict, f"{reason}; {failing[0].reason}", failing[0].estimate, failing[0].rule,
                             failing[0].n)
    return Judgement(Verdict.HOLDS, reason, judgements[0].estimate, judgements[0].rule, judgements[0].n)


def one_sweep(frames: list[pd.DataFrame], chosen: pd.DataFrame, sweep: str | None) -> tuple[list[pd.DataFrame], str | None]:
    """`frames` cut to one sweep: `sweep`, else the one with the most rows in `chosen` (the runs the
    claims are about; none: the frames emptied). A claim compares runs of one sweep: another sweep's
    runs of the same setting used other data, steps or attack options."""
    if sweep is None and not chosen.empty and "sweep" in chosen:
        sweep = str(chosen["sweep"].value_counts().idxmax())
    if sweep is None:
        # No run the claims are about: nothing to judge them on.
        return [frame.iloc[:0] for frame in frames], None
    return [frame[frame["sweep"] == sweep] if not frame.empty and "sweep" in frame else frame for frame in frames], sweep


def best_of_labels(attacks: pd.DataFrame, labels: Iterable[str], metric: str) -> pd.DataFrame:
    """Per run, the largest `metric` any of `labels` reached on it (the attacker keeps the replay
    that recovered more: a choice per run, made the same way on every run), one row per run with its
    settings."""
    chosen = attacks[attacks["attack"].isin(list(labels))] if not attacks.empty else attacks
    if chosen.empty or metric not in chosen:
        return chosen.iloc[:0]
    chosen = chosen.dropna(subset=[metric])
    return chosen.loc[chosen.groupby("run")[metric].idxmax()].reset_index(drop=True)


def strength(frame: pd.DataFrame, series: str, value: float | None) -> pd.DataFrame:
    """The rows of one defense series at one strength (None: the series has none)."""
    chosen = frame[frame["defense_series"] == series] if "defense_series" in frame else frame.iloc[:0]
    if value is not None and not chosen.empty:
        chosen = chosen[np.isclose(chosen["defense_strength"].astype(float), value)]
    return chosen
