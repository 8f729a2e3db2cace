"""Update-space canaries: crafted and scored as attacks.update_canaries says, audited by the one-run
bound, which never exceeds a DP-FedAvg round's epsilon and reaches past 2 without noise."""

import json

import numpy as np
import pytest

from attacks.context import ReplayContext
from attacks.metrics import one_run_audit
from attacks.update_canaries import UPDATE_CANARIES_FILE, CanarySet, UpdateCanaryAudit, read_scores
from config import load_config
from privacy.dp import calibrate_noise_multiplier

SHAPES = {"a": (40, 25), "b": (3000,)}


def test_the_included_canaries_add_the_norm_over_the_clients_on_their_own_coordinates():
    canaries = CanarySet(200, SHAPES, seed=0)
    added = canaries.contribution(norm=0.6, clients=3)
    flat = np.concatenate([added["a"].ravel(), added["b"]])
    assert added["a"].shape == (40, 25) and len(set(canaries.coordinates.tolist())) == 200
    on = canaries.coordinates[canaries.included]
    assert np.allclose(flat[on], canaries.signs[canaries.included] * 0.2)
    assert np.count_nonzero(flat) == canaries.included.sum() and 60 < canaries.included.sum() < 140


def test_a_canary_s_score_is_its_coordinate_s_signed_change_each_round():
    canaries = CanarySet(100, SHAPES, seed=1)
    before = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    after = {name: value + canaries.contribution(1.0, 2)[name] for name, value in before.items()}
    canaries.score_round(1, before, after)
    canaries.score_round(2, before, after)
    assert np.allclose(canaries.round_scores[1], np.where(canaries.included, 0.5, 0.0))
    assert np.allclose(canaries.round_scores[1] + canaries.round_scores[2], np.where(canaries.included, 1.0, 0.0))


def test_a_resume_keeps_the_committed_rounds_of_the_same_canaries_only():
    canaries = CanarySet(10, SHAPES, seed=2)
    zeros = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    for round_ in (1, 2, 3):
        canaries.score_round(round_, zeros, zeros)
    resumed = CanarySet(10, SHAPES, seed=2)
    resumed.load_scores(canaries.to_json(), through=2)
    assert sorted(resumed.round_scores) == [1, 2]
    with pytest.raises(ValueError, match="other canaries"):
        CanarySet(10, SHAPES, seed=3).load_scores(canaries.to_json(), through=2)


def test_more_canaries_than_coordinates_are_refused():
    with pytest.raises(ValueError, match="update canaries: 5000"):
        CanarySet(5000, {"a": (10,)}, seed=0)


def dp_fedavg_audit(z: float, rounds: int, trial: int, canaries: int = 1000, clients: int = 3) -> float:
    """DP-FedAvg's rounds on a model of 20,000 coordinates, its canaries added as attacks.update_canaries
    adds them, each round noised at z·C/n and three real clients' updates moving every coordinate a
    little; the one-run bound from the canaries' scores."""
    clip, rng = 1.0, np.random.default_rng(trial)
    shapes = {"w": (20000,)}
    canary_set = CanarySet(canaries, shapes, seed=trial)
    weights = {"w": np.zeros(20000)}
    for round_ in range(1, rounds + 1):
        real = rng.normal(0, 0.01, 20000)
        after = {"w": weights["w"] + real + canary_set.contribution(clip, clients)["w"]
                 + rng.normal(0, z * clip / clients, 20000)}
        canary_set.score_round(round_, weights, after)
        weights = after
    return one_run_audit(sum(canary_set.round_scores.values()), canary_set.included, 1e-4)["audit_epsilon"]


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_the_audit_of_dp_fedavg_never_exceeds_the_accountant_s_epsilon(epsilon):
    """10 seeded runs of 3 rounds at the noise the accountant calibrates to epsilon (δ = 1e-4):
    never above it; at epsilon 8, 1,000 canaries give a bound over 0.5 every time."""
    z = calibrate_noise_multiplier(epsilon, 1e-4, 3)
    bounds = [dp_fedavg_audit(z, 3, trial) for trial in range(10)]
    assert max(bounds) <= epsilon
    if epsilon == 8.0:
        assert min(bounds) > 0.5


def test_an_undefended_run_s_audit_passes_2():
    assert dp_fedavg_audit(0.0, 3, trial=0) > 2


def test_the_audit_attack_reads_a_run_s_committed_rounds(tmp_path, run_config):
    raw = run_config(paradigm="fl", **{"threat.update_canaries": 50, "output.name": "audited"})
    canaries = CanarySet(50, SHAPES, seed=0)
    zeros = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    plus = {name: zeros[name] + canaries.contribution(1.0, 2)[name] for name in SHAPES}
    canaries.score_round(1, zeros, plus)
    # Round 2 never committed: its scores (all wrong) must not count.
    canaries.score_round(2, plus, zeros)
    (tmp_path / UPDATE_CANARIES_FILE).write_text(json.dumps(canaries.to_json()))
    (tmp_path / "committed.json").write_text(json.dumps({"round": 1}))
    (tmp_path / "status.json").write_text(json.dumps({"privacy_spent": {"dp_epsilon": 3.0}}))
    scores, included = read_scores(tmp_path, through=1)
    assert np.allclose(scores, np.where(included, 0.5, 0.0))
    audit = UpdateCanaryAudit(knowledge=None).fit([])
    audit.prepare_replay(ReplayContext(tmp_path, load_config(raw), knowledge=None))
    result = audit.run(None)
    assert result.metrics["audit_canaries"] == 50 and result.metrics["accountant_epsilon"] == 3.0
    assert result.metrics["audit_epsilon"] > 0.5


def test_a_run_without_canaries_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="threat.update_canaries = 0"):
        read_scores(tmp_path, through=1)
