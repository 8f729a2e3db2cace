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
from wire import Wire
from process_death import Killed, kill_in_round


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


def test_a_resumed_audit_keeps_its_committed_rounds_and_scores_the_rest(run_config, fake_grid):
    raw = audited_config(run_config, "straight", 100, **{"train.rounds": 2})
    straight = json.loads((run(fake_grid(client_app, raw, 2), load_config(raw)).path / UPDATE_CANARIES_FILE).read_text())

    raw = audited_config(run_config, "resumed", 100, **{"train.rounds": 2})
    grid = fake_grid(client_app, raw, 2)
    grid.interceptors[1] = kill_in_round(2)
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


def adapters(message):
    record = message.content.array_records[protocol.ARRAYS]
    shapes = {key: tuple(array.shape) for key, array in record.items()}
    return Wire("fp32").decode(record, protocol.ADAPTER_UPDATE.expectation(adapter_shapes=shapes), what="adapters")


def poisson_config(run_config, name, **overrides):
    return run_config(paradigm="fl", **{"clients.count": 10, "clients.fraction_train": 0.4, "clients.sampling": "poisson",
                                        "data.train_limit": 40, "data.test_limit": 10, "train.steps_per_round": 1,
                                        "output.name": name, **overrides})


def test_a_poisson_round_sums_whoever_came_over_the_expected_cohort(run_config, fake_grid):
    """Under poisson sampling each of 10 clients comes by its own coin (4 expected): the rounds'
    cohorts differ, and the global adapters move by the sum of the updates over 4, not their mean."""
    raw = poisson_config(run_config, "poisson", **{"train.rounds": 3})
    grid = fake_grid(client_app, raw, 10)
    updates = {}

    def keep_update(message, reply):
        if message.metadata.message_type == protocol.TRAIN:
            sent, back = adapters(message), adapters(reply)
            round_ = message.content.config_records[protocol.CONFIG]["round"]
            updates.setdefault(round_, []).append({key: back[key] - sent[key] for key in sent})
        return reply

    grid.interceptors = dict.fromkeys(range(1, 11), keep_update)
    folder = run(grid, load_config(raw))
    cohorts = [json.loads(line)["clients_averaged"] for line in (folder.path / "metrics.jsonl").read_text().splitlines()]
    assert cohorts == [len(updates[r]) for r in (1, 2, 3)] and len(set(cohorts)) > 1
    before = torch.load(folder.checkpoint_path(2), weights_only=True)["arrays"]
    after = folder.load_checkpoint()["arrays"]
    for key in after:
        expected = before[key].float() + sum(update[key] for update in updates[3]) / 4
        assert torch.allclose(after[key].float(), expected, atol=1e-5)


def test_poisson_canaries_join_rounds_by_their_own_coins(run_config, fake_grid):
    """Canaries under poisson sampling: over 3 rounds an included canary's summed score is
    clip / 4 times the rounds its coin drew it, so included canaries score 0 to 3 quarters."""
    raw = poisson_config(run_config, "poisson-canaries", **{"train.rounds": 3, "threat.update_canaries": 300,
                                                            "privacy.dp.clip": 4.0})
    folder = run(fake_grid(client_app, raw, 10), load_config(raw))
    saved = json.loads((folder.path / UPDATE_CANARIES_FILE).read_text())
    included = np.asarray(saved["included"])
    joined = np.round(sum(np.asarray(s) for s in saved["round_scores"].values())[included]).astype(int)
    assert set(joined.tolist()) <= {0, 1, 2, 3} and len(set(joined.tolist())) >= 3
