"""SecAgg+ in whole FL runs (Flower's workflow and client mod as privacy.secagg configures them):
the aggregate is FedAvg's, the recorder holds only masked vectors, and a dropout is survived down
to the threshold."""

import json

import pytest
import torch
from flwr.app import Message

from attacks.replay import replay
from clients.app import app as client_app
from config import ConfigError, load_config
from strategies.app import run
from training import protocol
from training.model import load_party_model
from vlm.lora import owner_state_dict


def metrics(folder):
    return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]


def fl_config(run_config, name, secagg, **overrides):
    return run_config(**{"paradigm": "fl", "clients.count": 3, "train.steps_per_round": 2, "output.name": name,
                         "privacy.secagg.enabled": secagg, **overrides})


def drop_in_masked_vector_stage(message: Message, reply: Message) -> Message | None:
    """The client trains, then never answers the stage that collects its masked vector."""
    return None if protocol.ARRAYS in message.content.array_records else reply


def test_the_secure_aggregate_is_fedavg_s_and_its_bytes_include_the_protocol(run_config, fake_grid):
    plain_raw, secure_raw = fl_config(run_config, "plain", False), fl_config(run_config, "secure", True)
    plain = run(fake_grid(client_app, plain_raw, 3), load_config(plain_raw))
    secure = run(fake_grid(client_app, secure_raw, 3), load_config(secure_raw))
    want, got = plain.load_checkpoint()["arrays"], secure.load_checkpoint()["arrays"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-4)
    largest = max((got[key] - want[key]).abs().max().item() for key in want)
    print(f"largest difference from FedAvg's aggregate: {largest:.2e}")
    assert largest > 0  # quantised, not bypassed
    (plain_round,), (secure_round,) = metrics(plain), metrics(secure)
    assert secure_round["clients_averaged"] == 3 and secure_round["faults"] == []
    assert secure_round["train_loss"] == pytest.approx(plain_round["train_loss"])
    # Four stages of keys, shares and masked vectors cost more than one update each way.
    assert secure_round["bytes_up"] > plain_round["bytes_up"] and secure_round["bytes_down"] > plain_round["bytes_down"]


def test_idlg_on_a_secure_run_s_recording_recovers_no_client_s_labels(run_config, fake_grid):
    """The same passive recording as the FL iDLG test (which recovers every label), but the
    server received only masked vectors: iDLG reads nothing from them."""
    overrides = {"train.batch_size": 1, "train.steps_per_round": 1, "train.rounds": 3, "threat.model": "passive"}
    accuracy = {}
    for secagg in (False, True):
        raw = fl_config(run_config, f"secagg-{secagg}", secagg, **overrides)
        folder = run(fake_grid(client_app, raw, 3), load_config(raw))
        result = replay(folder.path, "idlg", options={"matching": False, "progress": False}, aux_limit=8)
        assert result.details["updates"] == 9
        accuracy[secagg] = result.metrics["top1_label_accuracy"]
    print(accuracy)
    assert accuracy[False] == 1.0
    assert accuracy[True] < 0.5


def test_a_client_that_drops_out_mid_protocol_is_left_out_of_the_sum(run_config, fake_grid):
    """Three clients, shares 3, threshold 2: one drops after the keys were shared, and the sum of
    the other two is unmasked — FedAvg of those two, as a run that trained only them would give."""
    raw = fl_config(run_config, "dropout", True, **{"privacy.secagg.threshold": 2})
    grid = fake_grid(client_app, raw, 3)
    grid.interceptors[3] = drop_in_masked_vector_stage
    folder = run(grid, load_config(raw))
    (record,) = metrics(folder)
    assert record["clients_averaged"] == 2
    assert [fault["client"] for fault in record["faults"]] == [3] and "SecAgg+" in record["faults"][0]["reason"]

    # The plain run whose third client never answers averages the other two's updates.
    plain_raw = fl_config(run_config, "plain", False)
    plain_grid = fake_grid(client_app, plain_raw, 3)
    plain_grid.interceptors[3] = lambda message, reply: None
    plain = run(plain_grid, load_config(plain_raw))
    want, got = plain.load_checkpoint()["arrays"], folder.load_checkpoint()["arrays"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-4)


def test_more_dropouts_than_the_threshold_allows_stop_the_round_with_the_reason(run_config, fake_grid):
    raw = fl_config(run_config, "halted", True, **{"privacy.secagg.threshold": 2})
    grid = fake_grid(client_app, raw, 3)
    grid.interceptors = {2: drop_in_masked_vector_stage, 3: drop_in_masked_vector_stage}
    with pytest.raises(RuntimeError, match="no client update could be averaged in round 1"):
        run(grid, load_config(raw))
    status = json.loads((load_config(raw).run_folder() / "status.json").read_text())
    assert status["state"] == "failed" and "SecAgg+" in status["error"]


@pytest.mark.parametrize(("overrides", "key"), [
    ({"paradigm": "usl"}, "privacy.secagg.enabled"),
    ({"clients.count": 2}, "privacy.secagg.enabled"),
    ({"clients.count": 5, "privacy.secagg.shares": 4}, "privacy.secagg.shares"),  # even, below the 5 sampled
    ({"privacy.secagg.threshold": 3}, "privacy.secagg.threshold"),
    ({"privacy.secagg.max_weight": 4.0}, "privacy.secagg.max_weight"),  # below 2 steps x 4 examples
    ({"privacy.dp.mode": "central", "privacy.dp.noise_multiplier": 1.0}, "privacy.dp.mode"),
])
def test_secagg_settings_that_cannot_run_are_refused_before_any_model_loads(overrides, key, run_config):
    with pytest.raises(ConfigError) as error:
        load_config(fl_config(run_config, "bad", True, **overrides))
    assert error.value.key == key


def test_secagg_composes_with_central_dp_whose_clients_clip(run_config, fake_grid):
    """Under SecAgg+ the clients clip (the server sees no single update) and the server noises the
    sum: the round's global update keeps within the clipping norm, up to quantisation, and the
    budget is spent for the three clients averaged."""
    clip = 1e-3
    raw = fl_config(run_config, "secure-dp", True, **{"privacy.dp.mode": "central-client-clipping",
                                                      "privacy.dp.clip": clip, "privacy.dp.noise_multiplier": 1e-9})
    folder = run(fake_grid(client_app, raw, 3), load_config(raw))
    party = load_party_model(load_config(raw))
    initial = owner_state_dict(party.model, party.segments[0])
    final = folder.load_checkpoint()["arrays"]
    update = torch.sqrt(sum(((final[k] - initial[k]) ** 2).sum() for k in final)).item()
    assert 0 < update <= 1.2 * clip
    (record,) = metrics(folder)
    assert record["clients_averaged"] == 3 and record["dp_releases"] == 1 and record["dp_epsilon"] > 0
