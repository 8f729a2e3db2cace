"""The membership audit: canaries in the run's data, the loss-threshold attack that sees what a
model memorised of them, and the audit's epsilon lower bound against the accountant's."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from attacks import build_attack
from attacks.replay import fit_for_run, replay
from attacks.truth import StaticTruth
from clients.app import app as client_app
from config import load_config
from sims.inprocess import InProcessGrid
from strategies.app import run
from training.data import RunData
from vlm.segments import llava_parts


def canary_data(run_config, canaries=24, **overrides):
    raw = run_config(**{"paradigm": "cl", "clients.count": 1, "data.train_limit": 48, "data.canaries": canaries, **overrides})
    return RunData.build(load_config(raw))


def test_canaries_are_rows_no_party_holds_each_put_in_its_clients_data_by_a_coin(run_config):
    data = canary_data(run_config, canaries=12, **{"paradigm": "fl", "clients.count": 2})
    plain = canary_data(run_config, canaries=0, **{"paradigm": "fl", "clients.count": 2})
    members, non_members = data.canary_members, data.canary_non_members
    assert len(members) + len(non_members) == 24 and members and non_members
    # The clients' own rows are untouched; the included canaries are appended to their shards.
    assert list(data.train_all)[: len(plain.train_all)] == list(plain.train_all)
    assert list(data.train_all)[len(plain.train_all) :] == list(members)
    shards = [list(data.train_shard(p)) for p in range(2)]
    assert all(any(c in shard for shard in shards) for c in members)
    assert sum(len(shard) for shard in shards) == len(plain.train_all) + len(members)
    held = {s.image_id for s in [*plain.train_all, *data.test_all]}
    assert not held & {c.image_id for c in [*members, *non_members]}
    again = canary_data(run_config, canaries=12, **{"paradigm": "fl", "clients.count": 2, "data.seed": 0})
    assert again.canary_members == members and again.canary_non_members == non_members


def test_the_loss_audit_sees_canaries_a_model_memorised_and_nothing_in_one_that_did_not(knowledge, tiny_model, run_config):
    """The target trains on the member canaries as MIA's test target does (the tiny model's head
    rescaled so that it can memorise random answers at all); the canaries its coin left out are
    the non-members. The one-run bound is positive only where there is something to see — and
    small even then: 24 canaries cap it below 2."""
    data = canary_data(run_config)
    model = tiny_model()
    with torch.no_grad():
        llava_parts(model).lm_head.weight.mul_(30)
    public = dataclasses.replace(knowledge, model=model)
    trainer = build_attack("mia", public, shadow_steps=400, shadow_lr=3e-3, batch_size=8, progress=False)
    target = trainer.train_shadow(list(data.canary_members), seed=123)
    canaries = (list(data.canary_members), list(data.canary_non_members))
    truth = StaticTruth(members=canaries[0], non_members=canaries[1], audit_canaries=canaries)
    attack = build_attack("mia_loss", public, candidates=24, attribute_records=0, progress=False).fit([])
    attack.audit_delta = 1e-5
    bounds = {}
    for name, queried in (("memorised", target), ("untrained", public.model)):
        result = attack.set_target(queried).run(None, truth)
        bounds[name] = (result.metrics["auc"], result.metrics["audit_epsilon"])
    assert bounds["memorised"][0] > 0.75 and bounds["memorised"][1] > 0
    assert bounds["untrained"][0] < 0.65 and bounds["untrained"][1] == 0.0


def test_the_audit_bound_of_a_dp_run_stays_below_its_accountant_s_epsilon(run_config):
    raw = run_config(paradigm="fl", **{"data.canaries": 4, "train.rounds": 2, "train.steps_per_round": 4, "threat.model": "passive",
                                       "privacy.dp.mode": "sgd", "privacy.dp.target_epsilon": 2.0, "privacy.dp.clip": 1.0})
    folder = run(InProcessGrid(client_app, raw, 2), load_config(raw))
    recorded = json.loads((folder.path / "canaries.json").read_text())
    assert len(recorded["members"]) + len(recorded["non_members"]) == 8
    result = replay(folder.path, "mia_loss", options={"candidates": 8, "attribute_records": 0, "progress": False})
    metrics = result.metrics
    assert metrics["accountant_epsilon"] == pytest.approx(2.0, abs=0.01)
    assert 0 <= metrics["audit_epsilon"] <= metrics["accountant_epsilon"]
    assert np.isfinite(metrics["auc"]) and metrics["audit_delta"] == 1e-5


def test_membership_queries_go_through_the_run_s_pruning_policy(run_config):
    """A client deploys its model behind its pruning policy; MIA queries it (and trains its
    shadows) the same way, so what pruning does to membership is what it measures."""
    raw = run_config(paradigm="fl", **{"data.canaries": 4, "threat.model": "passive", "pruning.policy": "fixed",
                                       "pruning.ratio": 0.75})
    folder = run(InProcessGrid(client_app, raw, 2), load_config(raw))
    attack = fit_for_run(folder.path, "mia_loss", options={"candidates": 8, "attribute_records": 0, "progress": False})
    data = RunData.build(load_config(raw))
    records = [*data.canary_members, *data.canary_non_members]
    features = torch.stack(list(attack.knowledge.features(attack.knowledge.pixel_values(records))))
    kept = attack.query_selector(features, records).keep
    assert all(len(indices) == 4 for indices in kept)  # 16 tiny patches, a quarter kept
    pruned = attack.membership_scores(attack.target, records)
    result = replay(folder.path, attack, save=False)
    assert result.details["queried_through"] == "fixed"
    attack.query_selector = None
    assert not np.allclose(attack.membership_scores(attack.target, records), pruned)
