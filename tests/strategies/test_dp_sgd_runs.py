"""DP-SGD in whole runs of every paradigm: the per-sample decomposition is exact (without clipping
and noise a step is the plain one), each client reports its budget, and settings DP-SGD cannot
honour are refused before any model loads."""

import json

import pytest
import torch

from clients import local, split
from clients.app import app as client_app
from config import ConfigError, load_config
from strategies.app import run
from training import protocol
from training.batches import batch_positions
from process_death import Killed, kill_in_round


def metrics(folder):
    return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("paradigm", ["cl", "fl", "sl", "usl"])
def test_without_clipping_or_noise_a_dp_sgd_step_is_the_plain_step(paradigm, run_config, fake_grid, monkeypatch):
    """The same batches (DP-SGD's own sampling swapped for the plain one), a clipping norm that
    never binds and negligible noise: the per-sample gradients sum to the batch gradient, so every
    optimiser step of the run (the server's and each client segment's) gets the plain run's
    gradients. Under DP-SGD each client reports its budget."""
    plain_batches = lambda config, n, step: batch_positions(n, config.train.batch_size, step, config.model.seed)  # noqa: E731
    monkeypatch.setattr(local, "train_positions", plain_batches)
    monkeypatch.setattr(split, "train_positions", plain_batches)
    stepped, original_step = [], torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        stepped.append([p.grad.detach().clone() for group in self.param_groups for p in group["params"] if p.grad is not None])
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    count = 1 if paradigm == "cl" else 2
    base = {"paradigm": paradigm, "clients.count": count, "train.rounds": 2, "train.steps_per_round": 2}
    gradients, folders = {}, {}
    for name, dp in (("plain", {}), ("sgd", {"privacy.dp.mode": "sgd", "privacy.dp.clip": 100.0,
                                            "privacy.dp.noise_multiplier": 1e-20})):
        stepped.clear()
        raw = run_config(**{**base, **dp, "output.name": name})
        folders[name] = run(fake_grid(client_app, raw, count), load_config(raw))
        gradients[name] = list(stepped)
    assert len(gradients["plain"]) == len(gradients["sgd"]) > 0
    for plain, private in zip(gradients["plain"], gradients["sgd"], strict=True):
        assert len(plain) == len(private)
        for want, got in zip(plain, private, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
    records = metrics(folders["sgd"])
    assert [r["dp_releases"] for r in records] == [2.0, 4.0]  # each client's steps so far
    assert 0 < records[0]["dp_epsilon"] < records[1]["dp_epsilon"]


def test_dp_sgd_with_real_noise_trains_and_spends_what_it_was_calibrated_to(run_config, fake_grid):
    raw = run_config(paradigm="usl", **{"train.rounds": 2, "train.steps_per_round": 2, "privacy.dp.mode": "sgd",
                                        "privacy.dp.clip": 0.1, "privacy.dp.target_epsilon": 8.0, "privacy.dp.delta": 1e-3})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    records = metrics(folder)
    assert records[-1]["dp_epsilon"] == pytest.approx(8.0, abs=0.01)
    status = json.loads((folder.path / "status.json").read_text())
    assert status["dp"]["mode"] == "sgd" and status["privacy_spent"]["dp_epsilon"] == records[-1]["dp_epsilon"]


def test_the_clip_only_control_clips_adds_no_noise_and_reports_no_epsilon(run_config, fake_grid):
    raw = run_config(paradigm="usl", **{"train.rounds": 1, "train.steps_per_round": 2, "privacy.dp.mode": "sgd",
                                        "privacy.dp.clip": 0.1, "privacy.dp.clip_only": True, "privacy.dp.delta": 1e-3})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    record = metrics(folder)[-1]
    assert record["dp_clip_only"] == 1.0 and record["dp_releases"] == 2.0 and "dp_epsilon" not in record
    for overrides in ({"privacy.dp.target_epsilon": 8.0}, {"privacy.dp.mode": "central"}):
        with pytest.raises(ConfigError) as error:
            load_config({**raw, **overrides})
        assert error.value.key == "privacy.dp.clip_only"


@pytest.mark.parametrize(("overrides", "key"), [
    ({"paradigm": "usl", "privacy.defenses": "nopeek"}, "privacy.dp.mode"),
    ({"paradigm": "cl", "clients.count": 1, "train.grad_accum": 2}, "privacy.dp.mode"),
    ({"paradigm": "sl", "privacy.dp.delta": 0.05}, "privacy.dp.delta"),  # >= 1/data.train_limit
])
def test_dp_sgd_settings_it_cannot_honour_are_refused(overrides, key, run_config):
    with pytest.raises(ConfigError) as error:
        load_config(run_config(**{"privacy.dp.mode": "sgd", "privacy.dp.noise_multiplier": 1.0, **overrides}))
    assert error.value.key == key


def test_a_resumed_dp_sgd_run_draws_the_same_batches_and_noise_and_spends_on(run_config, fake_grid, assert_same_outcome):
    """Killed in round 2 and resumed: each client's DP-SGD batches and noise are drawn by
    (partition, round, step), and its budget follows its step count, so the outcome is the
    uninterrupted run's."""
    dp = {"paradigm": "usl", "train.rounds": 2, "train.steps_per_round": 2, "privacy.dp.mode": "sgd",
          "privacy.dp.clip": 0.5, "privacy.dp.noise_multiplier": 1.0, "privacy.dp.delta": 1e-3}
    straight_raw = run_config(**{**dp, "output.name": "straight"})
    straight = run(fake_grid(client_app, straight_raw, 2), load_config(straight_raw))
    raw = run_config(**{**dp, "output.name": "resumed"})
    grid = fake_grid(client_app, raw, 2)
    grid.interceptors[2] = kill_in_round(2, protocol.USL_HEAD)
    with pytest.raises(Killed):
        run(grid, load_config(raw))
    resumed = run(fake_grid(client_app, raw, 2), load_config(raw))
    assert [r["dp_epsilon"] for r in metrics(resumed)] == [r["dp_epsilon"] for r in metrics(straight)]
    assert_same_outcome(straight.path, resumed.path)
