"""Steinke, Nasr & Jagielski's one-run audit: its bound at values the paper's arithmetic gives, its
caps by canary count, and against Gaussian mechanisms whose epsilon is known (never above it)."""

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from attacks.metrics import GUESS_SHARES, one_run_audit, one_run_epsilon, one_run_p_value


@pytest.mark.parametrize(("correct", "expected"), [(5, 0.20), (9, 0.93)])
def test_all_guesses_right_give_the_papers_bound_at_delta_0(correct, expected):
    assert one_run_epsilon(correct, correct, correct, delta=0.0) == pytest.approx(expected, abs=0.005)


@pytest.mark.parametrize(("canaries", "cap"), [(10, 1.05), (100, 3.5), (1000, 5.8), (10000, 7.8)])
def test_a_perfect_attacker_is_capped_by_the_canary_count(canaries, cap):
    assert one_run_epsilon(canaries, canaries, canaries, delta=1e-5) == pytest.approx(cap, abs=0.05)


def test_the_p_value_grows_with_epsilon_and_with_delta():
    values = [one_run_p_value(200, 100, 80, epsilon, 1e-5) for epsilon in (0.0, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[0] < 1e-3 < values[-1]
    assert one_run_p_value(200, 100, 80, 1.0, 1e-3) > one_run_p_value(200, 100, 80, 1.0, 0.0)


def test_guessing_at_chance_bounds_nothing():
    assert one_run_epsilon(1000, 200, 100, delta=1e-5) == 0.0


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="correct"):
        one_run_p_value(10, 5, 6, 1.0, 0.0)
    with pytest.raises(ValueError, match="one inclusion flag per score"):
        one_run_audit([0.1, 0.2], [True], 1e-5)


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """The tight epsilon of a sensitivity-1 Gaussian mechanism (dp-accounting's PLD)."""
    pld = privacy_loss_distribution.from_gaussian_mechanism(sigma, sensitivity=1.0, value_discretization_interval=1e-4)
    return pld.get_epsilon_for_delta(delta)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_a_gaussian_mechanisms_audit_never_exceeds_its_epsilon(sigma):
    """Each canary's coin adds 1 to its own score, released with Gaussian noise: the mechanism is
    (epsilon(sigma), delta)-DP in every canary. In 20 seeded trials of 1,000 canaries the bound stays
    below that epsilon, and where the mechanism leaks a lot it still sees a good part of it."""
    delta, canaries = 1e-5, 1000
    epsilon = gaussian_epsilon(sigma, delta)
    bounds = []
    for trial in range(20):
        rng = np.random.default_rng(trial)
        included = rng.random(canaries) < 0.5
        scores = included + rng.normal(0.0, sigma, canaries)
        bounds.append(one_run_audit(scores, included, delta)["audit_epsilon"])
    assert max(bounds) <= epsilon
    if sigma <= 1.0:
        assert min(bounds) > 0.5


def test_the_audit_reports_the_guess_it_bounded_with():
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    result = one_run_audit(included + rng.normal(0, 0.3, 400), included, 1e-5)
    assert result["audit_canaries"] == 400 and result["audit_correct"] <= result["audit_guesses"] <= 400
    assert result["audit_guesses"] in {2 * max(1, round(share * 400)) for share in GUESS_SHARES}
