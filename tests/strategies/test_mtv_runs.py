"""Federated DP-MTV (paradigm mtv) in whole in-process runs: the federated release is the central
mean of the clients' chunks, through the wire or SecAgg+, with its noise drawn once or by the
clients; private selection is charged; evaluation charges nothing."""

import json
import math
from dataclasses import replace

import pytest
import torch
from flwr.app import Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from attacks.recording import Recording
from attacks.replay import replay
from attacks.truth import RunTruth
from clients.app import app as client_app
from clients.mtv import own_chunks
from clients.runtime import build_runtime
from config import ConfigError, load_config
from privacy.dp_mtv import PrivacyLedger, release_task_vector
from strategies.app import run
from training import protocol
from vlm.task_vectors import chunk_activations, head_layout


def mtv_config(run_config, name, clients=2, **overrides):
    return run_config(**{"paradigm": "mtv", "clients.count": clients, "data.train_limit": 20 * clients,
                         "output.name": name, "privacy.mtv.chunks": 3 * clients, "privacy.mtv.shots": 2,
                         "privacy.mtv.epsilon": math.inf, "privacy.mtv.delta": 1e-3, "privacy.mtv.public_queries": 8,
                         "privacy.mtv.reinforce_steps": 1, **overrides})


def record(folder):
    (line,) = (folder.path / "metrics.jsonl").read_text().splitlines()
    return json.loads(line)


def released(folder):
    return torch.load(folder.path / protocol.TASK_VECTOR_FILE)


def central_activations(raw, tmp_path):
    """Every client's chunks read in one process, in partition order: what a central curator holding
    all the clients' rows would read from the same chunks."""
    config = load_config(raw)
    runtimes = [build_runtime(config, partition, tmp_path / f"central-{partition}") for partition in range(config.clients.count)]
    chunks = [chunk for rt in runtimes for chunk in own_chunks(rt)]
    rt = runtimes[0]
    rt.features.add([sample for chunk in chunks for sample in chunk if sample.image_id not in rt.features], progress=False)
    layout = head_layout(rt.model, config.privacy.mtv.layer_indices)
    return chunk_activations(rt.model, rt.tokenizer, rt.features, chunks, layout, instruction=rt.party.instruction,
                             progress=False), config.privacy.mtv


@pytest.mark.parametrize("epsilon", [math.inf, 2.0])
def test_the_federated_release_is_the_central_mean_of_the_clients_chunks(run_config, fake_grid, tmp_path, epsilon):
    raw = mtv_config(run_config, f"federated-{epsilon}", **{"privacy.mtv.epsilon": epsilon, "privacy.mtv.clip": 0.5})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    vector, row = released(folder), record(folder)
    activations, options = central_activations(raw, tmp_path)
    central, _ = release_task_vector(activations, replace(options, epsilon=math.inf), torch.Generator(),
                                     PrivacyLedger())
    if math.isinf(epsilon):
        torch.testing.assert_close(vector["values"], central, rtol=0, atol=1e-5)
        assert "dp_epsilon" not in row and row["mtv_noise_std"] == 0.0
        return
    # Private: the clipped mean plus the noise the ledger names, drawn once by the server.
    clipped = activations.flatten(2).norm(dim=-1).clamp(min=options.clip) / options.clip
    clipped_mean = (activations / clipped[..., None, None]).mean(0)
    noise = vector["values"] - clipped_mean
    (entry,) = vector["ledger"]["entries"]
    assert entry["epsilon"] == 2.0 and entry["drawn_by"] == "aggregator" and entry["chunks"] == 6
    assert noise.std().item() == pytest.approx(entry["noise_std"], rel=0.2)
    assert row["dp_epsilon"] == 2.0 and row["chunks"] == 6 and row["clients_averaged"] == 2
    # A share is one [layers, heads, head_dim] vector per client: its bytes, not an adapter set's.
    floats = math.prod(vector["values"].shape)
    assert all(4 * floats <= used["up"] < 4 * floats + 2048 for used in row["bytes_per_client"].values())


def test_secure_aggregation_gives_the_same_release_and_distributed_noise_is_the_clients(run_config, fake_grid):
    plain_raw = mtv_config(run_config, "plain", clients=3, **{"threat.model": "passive"})
    secure_raw = mtv_config(run_config, "secure", clients=3, **{"privacy.secagg.enabled": True, "threat.model": "passive"})
    plain_folder = run(fake_grid(client_app, plain_raw, 3), load_config(plain_raw))
    secure_folder = run(fake_grid(client_app, secure_raw, 3), load_config(secure_raw))
    plain, secure = released(plain_folder), released(secure_folder)
    difference = (secure["values"] - plain["values"]).abs().max().item()
    assert 0 < difference < 1e-4  # quantised by SecAgg+, not bypassed
    assert record(secure_folder)["round_trips_train"] == 4
    # A curious server recorded each client's sum in the clear, and under SecAgg+ only its masked vector.
    sums, masked = (Recording.open(folder.path) for folder in (plain_folder, secure_folder))
    kind = protocol.TASK_VECTOR_SHARE.name
    (plain_sums, secure_sums) = ([r.tensors(entry)[protocol.SHARE] for entry in r.select(kind)] for r in (sums, masked))
    assert len(plain_sums) == len(secure_sums) == 3
    torch.testing.assert_close(sum(plain_sums) / 9, plain["values"], rtol=0, atol=1e-5)
    assert all((s / 3 - m).abs().max() > 1.0 for s, m in zip(plain_sums, secure_sums, strict=True))

    distributed_raw = mtv_config(run_config, "distributed", clients=3, **{
        "privacy.secagg.enabled": True, "privacy.mtv.noise": "distributed", "privacy.mtv.epsilon": 2.0})
    (entry,) = released(run(fake_grid(client_app, distributed_raw, 3), load_config(distributed_raw)))["ledger"]["entries"]
    assert entry["drawn_by"] == "clients" and entry["epsilon"] == 2.0


def drop_in_masked_vector_stage(message: Message, reply: Message) -> Message | None:
    """The client computes its share, then never answers the stage that collects its masked vector."""
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if configs is not None and configs[Key.STAGE] == Stage.COLLECT_MASKED_VECTORS else reply


def test_a_distributed_release_missing_a_client_s_noise_is_charged_at_the_epsilon_it_has(run_config, fake_grid):
    raw = mtv_config(run_config, "dropout", clients=3, **{
        "privacy.secagg.enabled": True, "privacy.secagg.threshold": 2, "privacy.mtv.noise": "distributed",
        "privacy.mtv.epsilon": 2.0})
    grid = fake_grid(client_app, raw, 3)
    grid.interceptors[3] = drop_in_masked_vector_stage
    folder = run(grid, load_config(raw))
    row = record(folder)
    assert row["clients_averaged"] == 2 and row["chunks"] == 6
    assert [fault["client"] for fault in row["faults"]] == [3]
    (entry,) = released(folder)["ledger"]["entries"]
    assert entry["epsilon"] > 2.0  # two thirds of the noise variance arrived


def test_private_selection_is_charged_and_scoring_the_test_shares_charges_nothing(run_config, fake_grid):
    raw = mtv_config(run_config, "private", **{"privacy.mtv.epsilon": 1.0, "privacy.mtv.selection": "private",
                                               "privacy.mtv.selection_epsilon": 0.5, "eval.every": 1})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    row, vector = record(folder), released(folder)
    assert row["dp_epsilon"] == pytest.approx(1.5) and row["dp_epsilon_task_vector"] == 1.0
    assert [entry["mechanism"] for entry in vector["ledger"]["entries"]] == [
        "task vector (Gaussian)", "head selection (exponential mechanism)"]
    assert row["round_trips_train"] == 2 and row["round_trips_eval"] == 1
    assert row["test_count"] == 6 and 0 <= row["test_accuracy"] <= 1 and 0 <= row["zero_shot_accuracy"] <= 1
    status = json.loads((folder.path / "status.json").read_text())
    assert status["privacy_spent"]["dp_epsilon"] == pytest.approx(1.5) and status["dp"]["mechanism"] == "dp-mtv"


def test_a_share_claiming_more_chunks_than_its_partition_builds_is_refused(run_config, fake_grid):
    raw = mtv_config(run_config, "inflated")

    def inflate(message, reply):
        if message.metadata.message_type == protocol.TRAIN:
            reply.content.metric_records[protocol.METRICS]["num-examples"] = 100.0
        return reply

    grid = fake_grid(client_app, raw, 2)
    grid.interceptors[2] = inflate
    row = record(run(grid, load_config(raw)))
    assert row["chunks"] == 3 and row["clients_averaged"] == 1
    assert "reported 100 chunks" in row["faults"][0]["reason"]


@pytest.mark.parametrize(("overrides", "key", "allowed"), [
    ({"train.rounds": 2}, "train.rounds", "released once"),
    ({"privacy.mtv.chunks": 30}, "privacy.mtv.chunks", "at most 12"),
    ({"privacy.mtv.epsilon": 1.0, "privacy.mtv.delta": 0.05}, "privacy.mtv.delta", "< 1/data.train_limit"),
    ({"privacy.mtv.epsilon": math.nan}, "privacy.mtv.epsilon", "a finite number"),
    ({"privacy.mtv.noise": "distributed"}, "privacy.mtv.noise", "privacy.secagg.enabled"),
    ({"clients.count": 3, "data.train_limit": 60, "privacy.secagg.enabled": True, "privacy.mtv.selection": "private"},
     "privacy.mtv.selection", "public under privacy.secagg.enabled"),
    ({"privacy.mtv.layers": "1,9"}, "privacy.mtv.layers", "decoder layers"),
    # Distributed noise at ε = 0.1 has a per-client share far wider than SecAgg+'s default ±8.
    ({"clients.count": 3, "data.train_limit": 60, "privacy.secagg.enabled": True, "privacy.mtv.noise": "distributed",
      "privacy.mtv.epsilon": 0.1}, "privacy.secagg.clipping_range", "its noise share has std"),
    ({"privacy.defenses": "noise"}, "privacy.defenses", "defenses a mtv client can apply"),
])
def test_mtv_settings_that_cannot_run_are_refused_before_any_model_loads(run_config, overrides, key, allowed):
    with pytest.raises(ConfigError, match=allowed) as error:
        load_config(mtv_config(run_config, "bad", **overrides))
    assert error.value.key == key


def test_the_membership_audit_queries_the_release_on_the_canaries_its_chunks_showed(run_config, fake_grid, tmp_path):
    raw = mtv_config(run_config, "audit", **{"data.canaries": 16, "threat.model": "passive", "privacy.mtv.shots": 3,
                                             "privacy.mtv.chunks": 10, "privacy.mtv.selection": "private"})
    config = load_config(raw)
    folder = run(fake_grid(client_app, raw, 2), config)
    truth = RunTruth.from_run_folder(folder.path)
    members, non_members = truth.membership()
    # The members are exactly the canaries the clients placed as demonstrations (not as targets).
    canaries = {(s.image_id, s.question, s.answer) for s in truth.data.canary_members}
    shown = [(s.image_id, s.question, s.answer) for partition in range(2)
             for chunk in own_chunks(build_runtime(config, partition, tmp_path / f"audit-{partition}")) for s in chunk[:-1]]
    assert sorted((s.image_id, s.question, s.answer) for s in members) == sorted(k for k in shown if k in canaries)
    # The coins: every canary is held (shown or not) or left out, and both happen.
    assert 0 < len(members) <= len(truth.data.canary_members) and non_members == list(truth.data.canary_non_members)
    assert len(truth.data.canary_members) + len(non_members) == 32 and non_members
    result = replay(folder.path, "mtv_mia", options={"progress": False}, aux_limit=8)
    assert result.details["members"] == min(len(members), len(non_members)) and result.details["selected_heads"] > 0
    assert 0 <= result.metrics["auc"] <= 1 and result.metrics["audit_epsilon"] >= 0
    assert result.metrics["audit_canaries"] == 32
    assert result.metrics["mean_lift_members"] != 0  # the vector moved the canaries' answers
