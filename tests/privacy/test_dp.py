"""privacy.dp: its settings refused before any model loads, the calibrated noise, and the budget
against dp-accounting's own numbers."""

import dp_accounting
import pytest

from config import ConfigError, load_config
from privacy.dp import DPOptions, Federation, PrivacyBudget, calibrate_noise_multiplier


def library_epsilon(noise_multiplier, releases, delta, sampling_rate=1.0):
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    release = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_rate < 1:
        release = dp_accounting.PoissonSampledDpEvent(sampling_rate, release)
    accountant.compose(release, releases)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"privacy.dp.mode": "central", "privacy.dp.noise_multiplier": -1.0}, "privacy.dp.noise_multiplier"),
    ({"privacy.dp.mode": "central"}, "privacy.dp.noise_multiplier"),  # no noise: no guarantee
    ({"privacy.dp.mode": "central", "privacy.dp.noise_multiplier": 1.0, "privacy.dp.target_epsilon": 4.0},
     "privacy.dp.noise_multiplier"),
    ({"privacy.dp.mode": "central", "privacy.dp.noise_multiplier": 1.0, "privacy.dp.delta": 0.5}, "privacy.dp.delta"),
    ({"privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 1.0, "clients.count": 10, "data.test_limit": 10,
      "privacy.dp.delta": 0.1},
     "privacy.dp.delta"),
    ({"privacy.dp.mode": "central", "privacy.dp.target_epsilon": 1e-3, "train.rounds": 1000}, "privacy.dp.target_epsilon"),
    # Two clients give the clipped count a noise of 0.1: too little room for the update noise.
    ({"privacy.dp.mode": "central-adaptive", "privacy.dp.target_epsilon": 4.0}, "privacy.dp.target_epsilon"),
    ({"privacy.dp.mode": "centrall", "privacy.dp.noise_multiplier": 1.0}, "privacy.dp.mode"),
    ({"privacy.dp.mode": "central", "privacy.dp.noise_multiplier": 1.0, "paradigm": "usl"}, "privacy.dp.mode"),
    ({"privacy.dp.clip": 0.0}, "privacy.dp.clip"),
    ({"clients.sampling": "uniform"}, "clients.sampling"),
    ({"clients.sampling": "poisson"}, "clients.fraction_train"),  # every client every round: nothing to sample
    ({"clients.count": 10, "data.test_limit": 10, "clients.fraction_train": 0.25, "clients.sampling": "poisson"},
     "clients.fraction_train"),  # 2.5 clients expected
    ({"clients.count": 10, "data.test_limit": 10, "clients.fraction_train": 0.5, "clients.sampling": "poisson",
      "privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 1.0, "privacy.dp.delta": 1e-3}, "clients.sampling"),
    ({"clients.count": 10, "data.test_limit": 10, "clients.fraction_train": 0.5, "clients.sampling": "poisson",
      "paradigm": "usl"}, "clients.sampling"),
])
def test_bad_dp_settings_are_refused_naming_the_key_before_any_model_loads(overrides, key, run_config):
    raw = run_config(**{"paradigm": "fl", **overrides})
    with pytest.raises(ConfigError) as error:
        load_config(raw)
    assert error.value.key == key


def test_the_calibrated_noise_spends_the_target_over_the_run_s_rounds():
    z = calibrate_noise_multiplier(4.0, 1e-5, 5)
    assert library_epsilon(z, 5, 1e-5) == pytest.approx(4.0, abs=1e-3)
    assert library_epsilon(z * 0.98, 5, 1e-5) > 4.0  # the smallest noise that meets it


@pytest.mark.parametrize("mode", ["central", "local"])
def test_the_budget_is_the_library_s_epsilon_and_continues_across_a_reload(mode):
    options = DPOptions(mode=mode, noise_multiplier=1.3, delta=1e-4)
    federation = Federation(clients=4, sampled=4, rounds=6)
    straight = PrivacyBudget(options, federation)
    spent = [straight.release(4, 4)["dp_epsilon"] for _ in range(6)]
    assert spent == sorted(spent) and spent[-1] == pytest.approx(library_epsilon(1.3, 6, 1e-4))

    first = PrivacyBudget(options, federation)
    for _ in range(3):
        first.release(4, 4)
    resumed = PrivacyBudget(options, federation)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.release(4, 4)["dp_epsilon"] for _ in range(3)] == pytest.approx(spent[3:])


def test_a_round_averaged_over_fewer_clients_spends_more():
    """Central noise is calibrated to the sampled clients' average; one client missing leaves the
    others' updates less noise each, and the release is composed at that smaller multiplier."""
    options = DPOptions(mode="central", noise_multiplier=2.0)
    budget = PrivacyBudget(options, Federation(clients=4, sampled=4, rounds=1))
    assert budget.release(3, 4)["dp_epsilon"] == pytest.approx(library_epsilon(2.0 * 3 / 4, 1, 1e-5))


def test_poisson_sampling_is_amplified_by_the_library_s_accountant():
    """Each client in a round with probability 1/10: the calibrated noise meets the target as
    dp-accounting's Poisson-subsampled Gaussian, and is less than unsampled rounds need; a fault
    changes nothing (the round's denominator is the expected cohort)."""
    z = calibrate_noise_multiplier(4.0, 1e-5, 20, sampling_rate=0.1)
    assert library_epsilon(z, 20, 1e-5, 0.1) == pytest.approx(4.0, abs=1e-3)
    assert z < calibrate_noise_multiplier(4.0, 1e-5, 20)
    federation = Federation(clients=100, sampled=10, rounds=20, poisson=True)
    budget = PrivacyBudget(DPOptions(mode="central", target_epsilon=4.0), federation)
    assert budget.noise_multiplier == pytest.approx(z)
    for kept in [10] * 19 + [7]:
        spent = budget.release(kept, 10)["dp_epsilon"]
    assert spent == pytest.approx(4.0, abs=1e-3)
