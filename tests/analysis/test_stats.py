"""Verdicts from paired bootstrap intervals: each class comes out where it should, and the API
cannot compare the best of several runs."""

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from analysis.stats import (ABOVE, BELOW, MIN_SEEDS, WITHIN, Floor, Rule, UnpairedError, Verdict, bootstrap, compare,
                            bootstrap_auroc, estimate, outcomes, paired_differences, rank_auroc, wilson)


def frame(settings: dict[str, list[list[float]]], seeds=None) -> pd.DataFrame:
    """One row per setting, seed and item: settings name -> per seed, the items' scores."""
    rows = []
    for setting, per_seed in settings.items():
        for index, scores in enumerate(per_seed):
            seed = index if seeds is None else seeds[index]
            rows.extend({"policy": setting, "run": f"{setting}-s{seed}", "seed": seed, "item": f"q{item}", "score": score}
                        for item, score in enumerate(scores))
    return pd.DataFrame(rows)


def correct(rng, share: float, count: int = 400) -> list[float]:
    return (rng.random(count) < share).astype(float).tolist()


def test_a_clear_gain_holds_and_a_clear_loss_does_not():
    rng = np.random.default_rng(0)
    data = frame({"off": [correct(rng, 0.5) for _ in range(3)], "dtp": [correct(rng, 0.8) for _ in range(3)]})
    off, dtp = outcomes(data, policy="off"), outcomes(data, policy="dtp")
    gain = compare(off, dtp, Rule(0.0, ABOVE))
    assert gain.verdict is Verdict.HOLDS and gain.estimate.low > 0.2
    assert compare(dtp, off, Rule(0.0, ABOVE)).verdict is Verdict.DOES_NOT_HOLD
    assert compare(off, dtp, Rule(0.0, BELOW)).verdict is Verdict.DOES_NOT_HOLD
    assert gain.n == "3 seeds × 400 items"


def test_an_interval_straddling_the_margin_is_inconclusive():
    rng = np.random.default_rng(1)
    data = frame({"off": [correct(rng, 0.6, 60) for _ in range(3)], "dtp": [correct(rng, 0.6, 60) for _ in range(3)]})
    judgement = compare(outcomes(data, policy="off"), outcomes(data, policy="dtp"), Rule(-0.01, ABOVE))
    assert judgement.estimate.low < -0.01 < judgement.estimate.high
    assert judgement.verdict is Verdict.INCONCLUSIVE


def test_an_attack_at_its_floor_is_not_testable():
    # An attack whose undefended PSNR sits at the mean image's: a defense has nothing to remove.
    rng = np.random.default_rng(2)
    data = frame({"none": [list(20 + 0.1 * rng.standard_normal(50)) for _ in range(3)],
                  "noise": [list(20 + 0.1 * rng.standard_normal(50)) for _ in range(3)]})
    floor = Floor(20.0, 1.0, "the mean image's PSNR")
    judgement = compare(outcomes(data, policy="none"), outcomes(data, policy="noise"), Rule(0.0, BELOW), floor=floor)
    assert judgement.verdict is Verdict.NOT_TESTABLE and "floor" in judgement.reason
    # The estimate shown is still the difference (about 0), not the reference's level (20).
    assert abs(judgement.estimate.value) < 0.1
    lifted = frame({"none": [list(25 + rng.standard_normal(50)) for _ in range(3)],
                    "noise": [list(20 + rng.standard_normal(50)) for _ in range(3)]})
    judged = compare(outcomes(lifted, policy="none"), outcomes(lifted, policy="noise"), Rule(0.0, BELOW), floor=floor)
    assert judged.verdict is Verdict.HOLDS


def test_too_few_seeds_is_not_testable():
    rng = np.random.default_rng(3)
    data = frame({"off": [correct(rng, 0.5)] * (MIN_SEEDS - 1), "dtp": [correct(rng, 0.9)] * (MIN_SEEDS - 1)})
    judgement = compare(outcomes(data, policy="off"), outcomes(data, policy="dtp"), Rule(0.0, ABOVE))
    assert judgement.verdict is Verdict.NOT_TESTABLE and f"at least {MIN_SEEDS}" in judgement.reason
    assert estimate(outcomes(data, policy="dtp"), Rule(0.5, ABOVE)).verdict is Verdict.NOT_TESTABLE


def test_a_setting_cannot_be_cut_down_to_its_best_run():
    rng = np.random.default_rng(4)
    data = frame({"off": [correct(rng, 0.5) for _ in range(3)]})
    for column in ("seed", "run", "folder"):
        with pytest.raises(ValueError, match="best of N"):
            outcomes(data, policy="off", **{column: 1})
    # Two runs of one setting at one seed: the setting is underspecified, not a choice to make silently.
    doubled = pd.concat([data, data.assign(run=data["run"] + "-again")])
    with pytest.raises(ValueError, match="matches 2 runs at seed 0"):
        outcomes(doubled, policy="off")


def test_unpaired_settings_are_refused():
    rng = np.random.default_rng(5)
    data = frame({"off": [correct(rng, 0.5, 20) for _ in range(3)]})
    other = frame({"dtp": [correct(rng, 0.5, 20) for _ in range(3)]}, seeds=[0, 1, 7])
    with pytest.raises(UnpairedError, match="same seeds"):
        paired_differences(outcomes(data, policy="off"), outcomes(other, policy="dtp"))
    # A comparison pairs the seeds both ran: here two, too few for a verdict.
    judged = compare(outcomes(data, policy="off"), outcomes(other, policy="dtp"), Rule(0.0, ABOVE))
    assert judged.verdict is Verdict.NOT_TESTABLE and "2 seed(s)" in judged.reason
    fewer = frame({"dtp": [correct(rng, 0.5, 19) for _ in range(3)]})
    with pytest.raises(UnpairedError, match="different items"):
        paired_differences(outcomes(data, policy="off"), outcomes(fewer, policy="dtp"))
    # A reference from another start of the sweep is not the point's reference.
    later = frame({"dtp": [correct(rng, 0.5, 20) for _ in range(3)]}).assign(start="def456")
    with pytest.raises(UnpairedError, match="same start"):
        paired_differences(outcomes(data.assign(start="abc123"), policy="off"), outcomes(later, policy="dtp"))


def test_too_few_seeds_keeps_the_interval_over_the_items():
    rng = np.random.default_rng(7)
    data = frame({"off": [correct(rng, 0.3, 300)], "dtp": [correct(rng, 0.9, 300)]})
    judged = compare(outcomes(data, policy="off"), outcomes(data, policy="dtp"), Rule(0.0, ABOVE))
    assert judged.verdict is Verdict.NOT_TESTABLE and judged.estimate.low > 0.4 and judged.n == "1 seed × 300 items"


def test_an_equivalence_rule_holds_inside_its_margin_and_fails_outside():
    rng = np.random.default_rng(8)
    same = frame({"central": [correct(rng, 0.6, 2000) for _ in range(3)],
                  "federated": [correct(rng, 0.6, 2000) for _ in range(3)],
                  "worse": [correct(rng, 0.4, 2000) for _ in range(3)]})
    central = outcomes(same, policy="central")
    assert compare(central, outcomes(same, policy="federated"), Rule(0.05, WITHIN)).verdict is Verdict.HOLDS
    assert compare(central, outcomes(same, policy="worse"), Rule(0.05, WITHIN)).verdict is Verdict.DOES_NOT_HOLD


def test_the_interval_widens_with_the_spread_between_seeds():
    rng = np.random.default_rng(6)
    within = [0.5 + 0.1 * rng.standard_normal(200) for _ in range(4)]
    between = [values + shift for values, shift in zip(within, (-0.2, -0.1, 0.1, 0.2), strict=True)]
    narrow, wide = bootstrap(within), bootstrap(between)
    assert narrow.low < narrow.value < narrow.high
    assert (wide.high - wide.low) > 3 * (narrow.high - narrow.low)


def test_a_rule_names_its_allowed_directions():
    with pytest.raises(ValueError, match="Rule.direction is 'up'"):
        Rule(0.0, "up")


def test_a_share_reported_alone_has_its_wilson_interval():
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-3) and high == pytest.approx(0.9433, abs=1e-3)
    assert wilson(0, 10)[0] == pytest.approx(0.0) and np.isnan(wilson(0, 0)[0])


def test_an_auroc_is_bootstrapped_over_its_groups():
    scores = np.array([[0.9, 0.1, 0.2], [0.8, 0.3, 0.1], [0.4, 0.6, 0.2]])
    labels = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 0]])
    auroc = bootstrap_auroc(scores, labels)
    assert auroc.low <= auroc.value <= auroc.high and auroc.items == 3 and auroc.value < 1.0


def test_the_batched_auroc_is_sklearns_row_by_row_ties_included():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, size=(50, 40)).astype(float)  # many ties
    labels = rng.random((50, 40)) < 0.3
    labels[0] = False  # one class only: no AUROC
    found = rank_auroc(scores, labels)
    assert np.isnan(found[0])
    assert found[1:] == pytest.approx([roc_auc_score(y, x) for x, y in zip(scores[1:], labels[1:], strict=True)])
