"""The auditor's canary clients in whole FL runs: they join the average inside the DP wrapper (their
share is in the global model exactly, under the same noise as a run without them), their scores
are written each round and survive a resume, and the audit attack reads them."""

import json

import numpy as np
import pytest
import torch

from attacks.context import ReplayContext
from attacks.update_canaries import UPDATE_CANARIES_FILE, CanarySet, UpdateCanaryAudit
from clients.app import app as client_app
from config import load_config
from strategies.app import run
from training import protocol


def audited_config(run_config, name, canaries, **overrides):
    return run_config(paradigm="fl", **{"train.steps_per_round": 2, "train.rounds": 1, "output.name": name,
                                        "privacy.dp.mode": "central", "privacy.dp.clip": 0.05,
                                        "privacy.dp.noise_multiplier": 0.5, "threat.update_canaries": canaries,
                                        **overrides})


def test_the_included_canaries_join_the_noised_average_as_clients(run_config, fake_grid):
    """One round with and without 200 canaries, alike otherwise (the DP noise is seeded per round):
    the global adapters differ by the canaries' share, clip / 2 on each included canary's coordinate
    (2 clients), and by nothing else."""
    finals, folders = {}, {}
    for name, canaries in (("plain", 0), ("audited", 200)):
        raw = audited_config(run_config, name, canaries)
        folders[name] = run(fake_grid(client_app, raw, 2), load_config(raw))
        finals[name] = folders[name].load_checkpoint()["arrays"]
    shapes = {key: tuple(value.shape) for key, value in finals["plain"].items()}
    expected = CanarySet(200, shapes, seed=0).contribution(0.05, 2)
    for key in shapes:
        assert torch.allclose(finals["audited"][key] - finals["plain"][key], torch.from_numpy(expected[key]), atol=1e-6)
    saved = json.loads((folders["audited"].path / UPDATE_CANARIES_FILE).read_text())
    assert list(saved["round_scores"]) == ["1"] and sum(saved["included"]) == np.count_nonzero(
        np.concatenate([value.ravel() for value in expected.values()]))
    assert not (folders["plain"].path / UPDATE_CANARIES_FILE).exists()


class Killed(BaseException):
    """Stands in for the server process dying."""


def test_a_resumed_audit_keeps_its_committed_rounds_and_scores_the_rest(run_config, fake_grid):
    raw = audited_config(run_config, "straight", 100, **{"train.rounds": 2})
    straight = json.loads((run(fake_grid(client_app, raw, 2), load_config(raw)).path / UPDATE_CANARIES_FILE).read_text())

    raw = audited_config(run_config, "resumed", 100, **{"train.rounds": 2})
    grid = fake_grid(client_app, raw, 2)

    def kill_in_round_two(message, reply):
        if message.content.config_records[protocol.CONFIG]["round"] == 2:
            raise Killed
        return reply

    grid.interceptors[1] = kill_in_round_two
    with pytest.raises(Killed):
        run(grid, load_config(raw))
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    resumed = json.loads((folder.path / UPDATE_CANARIES_FILE).read_text())
    assert list(resumed["round_scores"]) == ["1", "2"]
    assert np.allclose(resumed["round_scores"]["2"], straight["round_scores"]["2"], atol=1e-6)

    audit = UpdateCanaryAudit(knowledge=None).fit([])
    audit.prepare_replay(ReplayContext(folder.path, load_config(raw), knowledge=None))
    metrics = audit.run(None).metrics
    assert metrics["audit_canaries"] == 100 and metrics["accountant_epsilon"] > 0
    assert 0 <= metrics["audit_epsilon"] <= metrics["accountant_epsilon"]
