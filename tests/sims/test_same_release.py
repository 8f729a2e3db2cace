"""Whether a federated task-vector release scores like the central one: the spread of one draw is
pooled within each setting's draws, so two tight settings far apart are told apart."""

import pandas as pd

from sims import results as R


def draws(*accuracies: float) -> pd.DataFrame:
    return pd.DataFrame({"test_accuracy": accuracies, "test_count": [200] * len(accuracies)})


def test_two_tight_settings_ten_points_apart_are_not_the_same_release():
    # Spread over all four draws (0.058) would take the 10-point gap for noise; within each it is 0.007.
    holds, reason = R._same_release(draws(0.50, 0.51), draws(0.60, 0.61))
    assert holds is False and "pooled" in reason


def test_draws_of_one_spread_around_one_mean_are_the_same_release():
    assert R._same_release(draws(0.50, 0.60), draws(0.52, 0.58))[0] is True
    assert R._same_release(draws(0.55), draws(0.50, 0.60))[0] is True  # one federated draw: the central spread


def test_one_central_draw_is_judged_by_its_test_interval():
    assert R._same_release(draws(0.52), draws(0.50))[0] is True
    assert R._same_release(draws(0.70), draws(0.50))[0] is False
    assert R._same_release(draws(), draws(0.5))[0] is None
