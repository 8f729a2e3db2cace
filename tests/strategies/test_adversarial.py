"""The threat models: a passive server records exactly what crossed its wire; an FSHA server
hijacks the clients' fronts inside a real run, and both recordings replay. (That a hijacking
USL server still sees only the cuts is test_usl_privacy's.)"""

import copy
import json

import pytest
import torch
from flwr.app import Context, RecordDict

from attacks import Recording
from attacks.fsha import FSHA, STATE_FILE
from attacks.knowledge import split_packed, visual_rows
from attacks.context import ATTACK_FOLDER
from attacks.replay import knowledge_for_run, replay
from clients.app import app as client_app
from config import ConfigError, load_config
from strategies import app as server_app
from strategies.app import run
from training import protocol
from training.data import RunData
from training.model import load_party_model
from training.store import PrivateStore
from vlm.cuts import split_layers
from vlm.lora import load_owner_state_dict, owner_state_dict
from vlm.profiles import TINY
from wire import Wire

# What each paradigm's server sends that attacks replay: message type, record key, recorded kind.
DECLARED_SENT = {
    "usl": (protocol.USL_TAIL, protocol.TENSORS, "activation at CB"),
    "fl": ("train", protocol.ARRAYS, "global adapters"),
}
FAST_FSHA = {"threat.fsha_pretrain_steps": 20, "threat.fsha_decoder_width": 16, "threat.aux_limit": 32}


def sent_tensors(record, dtype: str) -> dict[str, torch.Tensor]:
    """A sent payload decoded as its client decodes it."""
    expected = {name: (tuple(a.shape), "index" if a.dtype == "int32" else "float") for name, a in record.items()}
    return Wire(dtype).decode(record, expected, what="sent")


def status(folder) -> dict:
    return json.loads((folder.path / "status.json").read_text())


@pytest.mark.parametrize("paradigm", ["usl", "sl", "fl"])
def test_a_passive_server_records_exactly_what_it_received_and_the_payloads_it_names(
    paradigm, run_config, fake_grid, monkeypatch
):
    raw = run_config(paradigm=paradigm, **{"threat.model": "passive", "wire.dtype": "bf16", "train.rounds": 2,
                                           "train.steps_per_round": 2, "eval.every": 2})
    grid = fake_grid(client_app, raw, 2)
    sent = []
    message_type, record_key, sent_kind = DECLARED_SENT.get(paradigm, (None, None, None))

    def keep_declared(message, reply):
        if message.metadata.message_type == message_type:
            round_ = message.content.config_records[protocol.CONFIG]["round"]
            sent.append((round_, message.metadata.dst_node_id,
                         sent_tensors(message.content.array_records[record_key], "bf16")))
        return reply

    for node in (1, 2):
        grid.interceptors[node] = keep_declared
    received = []
    monkeypatch.setattr(server_app, "OBSERVER_FACTORIES", [lambda config, folder: received.append])
    folder = run(grid, load_config(raw))

    recording = Recording.open(folder.path)
    assert recording.config["threat.model"] == "passive" and status(folder)["threat_model"] == "passive"
    up = [e for e in recording.entries if e.direction == "up"]
    down = [e for e in recording.entries if e.direction == "down"]
    assert [(e.round, e.client, e.kind) for e in up] == [(t.round, t.client, t.kind) for t in received]
    for entry, transfer in zip(up, received, strict=True):
        stored = recording.tensors(entry) if entry.stored else {}
        assert stored.keys() == transfer.tensors.keys()
        assert all(torch.equal(stored[name], transfer.tensors[name]) for name in stored)
    assert {e.kind for e in down} <= {sent_kind}
    assert [(e.round, e.client) for e in down] == [(round_, node) for round_, node, _ in sent]
    for entry, (_, _, tensors) in zip(down, sent, strict=True):
        stored = recording.tensors(entry)
        assert stored.keys() == tensors.keys() and all(torch.equal(stored[n], tensors[n]) for n in tensors)
    assert len(down) == {"usl": 2 * 2 * 2, "fl": 2 * 2, "sl": 0}[paradigm]


@pytest.mark.parametrize("cap", ["max_bytes", "max_samples"])
def test_the_recording_stores_a_prefix_of_the_run_within_its_cap(cap, run_config, fake_grid):
    uncapped_raw = run_config(**{"threat.model": "passive", "train.steps_per_round": 3, "output.name": "whole"})
    whole = Recording.open(run(fake_grid(client_app, uncapped_raw, 2), load_config(uncapped_raw)).path)
    stored = [e for e in whole.entries if e.stored]
    # A cap that the first half of the stored transfers fill.
    half = stored[: len(stored) // 2]
    limit = sum(e.tensor_bytes for e in half) if cap == "max_bytes" else sum(e.samples for e in half)
    raw = {**uncapped_raw, "output.name": "capped", f"threat.{cap}": limit}
    capped = Recording.open(run(fake_grid(client_app, raw, 2), load_config(raw)).path)

    assert [(e.kind, e.direction) for e in capped.entries] == [(e.kind, e.direction) for e in whole.entries]
    kept = [e for e in capped.entries if e.stored]
    assert [e.seq for e in kept] == [e.seq for e in half]
    assert sum(e.tensor_bytes if cap == "max_bytes" else e.samples for e in kept) <= limit
    assert capped.header["cap"][cap] == limit


@pytest.mark.parametrize(("paradigm", "overrides"), [("usl", {}), ("fl", {"train.batch_size": 1, "train.rounds": 2})])
def test_a_passive_recording_replays_idlg(paradigm, overrides, run_config, fake_grid):
    # USL: the gradient at CB with the rows the server sent to the tail; FL, round 2: the update
    # against the global adapters the server sent that round. Both are read from the "down" record.
    raw = run_config(paradigm=paradigm, **{"threat.model": "passive", **overrides})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    result = replay(folder.path, "idlg", options={"matching": False, "progress": False}, aux_limit=8)
    print(result.metrics)
    accuracy = result.metrics["label_accuracy" if paradigm == "usl" else "top1_label_accuracy"]
    assert accuracy == 1.0


def test_a_bad_threat_config_fails_before_any_model_loads(run_config, fake_grid, monkeypatch, tmp_path):
    def no_model(config):
        raise AssertionError("a model loaded before the config was checked")

    monkeypatch.setattr(server_app, "load_party_model", no_model)
    raw = run_config(paradigm="fl", **{"threat.model": "active-fsha"})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=raw)
    with pytest.raises(ConfigError, match=r"threat.model='active-fsha'.*of paradigm fl: none, passive"):
        server_app.main(fake_grid(client_app, raw, 2), context)
    assert not (tmp_path / "run").exists()


def first_cut_gradients(paradigm: str, threat: str, pruning: dict, run_config, fake_grid) -> tuple[list[torch.Tensor], object]:
    """The gradients client 1 got at the first cut in a one-step run, and the run folder."""
    backward = {"usl": protocol.USL_HEAD, "sl": protocol.SL_BACKWARD}[paradigm]
    raw = run_config(paradigm=paradigm, **{"threat.model": threat, "output.name": threat, **pruning, **FAST_FSHA})
    grid = fake_grid(client_app, raw, 2)
    grads = []

    def keep_gradient(message, reply):
        if message.metadata.message_type == backward:
            grads.append(sent_tensors(message.content.array_records[protocol.TENSORS], "fp32")["grad"])
        return reply

    grid.interceptors[1] = keep_gradient
    return grads, run(grid, load_config(raw))


# Under pruning the server finds where each sample's kept visual rows end (attacks.observations.VisualSpans).
@pytest.mark.parametrize(("paradigm", "prune_ratio"), [("usl", 0.0), ("sl", 0.0), ("usl", 0.5)])
def test_an_fsha_server_returns_its_own_gradient_and_leaves_its_segment_untrained(
    paradigm, prune_ratio, run_config, fake_grid
):
    pruning = {"pruning.policy": "fixed", "pruning.ratio": prune_ratio} if prune_ratio else {}
    honest, honest_folder = first_cut_gradients(paradigm, "passive", pruning, run_config, fake_grid)
    hijacked, folder = first_cut_gradients(paradigm, "active-fsha", pruning, run_config, fake_grid)
    assert status(folder)["state"] == "finished" and status(folder)["threat_model"] == "active-fsha"
    assert (folder.path / ATTACK_FOLDER / STATE_FILE).is_file()

    # Same client, same batch, same front: only the server's answer differs.
    (honest_grad,), (fsha_grad,) = honest, hijacked
    assert honest_grad.shape == fsha_grad.shape and not torch.allclose(honest_grad, fsha_grad)
    lengths = Recording.open(folder.path).tensors(Recording.open(folder.path).select(
        {"usl": "activation at CA", "sl": "activation at C"}[paradigm])[0])["lengths"]
    prefix, visual = 2, round(TINY.num_patches * (1 - prune_ratio))  # "USER:" and the kept patches
    for honest_sample, sample in zip(split_packed(honest_grad, lengths), split_packed(fsha_grad, lengths), strict=True):
        # The honest gradient reaches the question's rows; FSHA's only the image's.
        assert sample[prefix : prefix + visual].abs().sum(-1).gt(0).all() and sample[:prefix].abs().sum() == 0
        assert sample[prefix + visual :].abs().sum() == 0 and honest_sample[prefix + visual :].abs().sum() > 0

    # The hijacking server never trained its segment: its adapters are still the seeded ones.
    honest_lora = torch.load(honest_folder.checkpoint_path(1), weights_only=True)["lora"]
    state = torch.load(folder.checkpoint_path(1), weights_only=True)
    initial = owner_lora(load_config(run_config(paradigm=paradigm)), {"usl": "body", "sl": "server"}[paradigm])
    assert all(torch.equal(state["lora"][k], initial[k]) for k in initial)
    assert any(not torch.equal(honest_lora[k], initial[k]) for k in initial)
    assert set(state["hijack"]) >= {"pilot", "decoder", "discriminator"}


def owner_lora(config, owner: str) -> dict[str, torch.Tensor]:
    """The seeded adapters of `owner`'s segment, as every party starts them."""
    party = load_party_model(config)
    return owner_state_dict(party.model, next(s for s in party.segments if s.owner == owner))


def test_a_hijacked_client_moves_its_features_to_the_pilots_and_the_replay_decodes_them(
    run_config, fake_grid, monkeypatch
):
    # One client, 100 steps at lr 1e-3 (a faster client overshoots the moving pilot), in 5 rounds
    # so the replay decodes only the last round's 20 steps.
    raw = run_config(**{
        "threat.model": "active-fsha", "clients.count": 1, "data.train_limit": 32, "train.rounds": 5,
        "train.steps_per_round": 20, "train.batch_size": 16, "train.lr": 1e-3, "threat.aux_limit": 128,
        "threat.fsha_pretrain_steps": 100, "threat.fsha_discriminator_steps": 5, "threat.fsha_decoder_width": 32,
    })
    folder = run(fake_grid(client_app, raw, 1), load_config(raw)).path
    config = load_config(raw)
    data = RunData.build(config)
    knowledge = knowledge_for_run(config)
    server = FSHA(knowledge, pretrain_steps=0, decoder_width=32, progress=False)
    server.fit(data.auxiliary(8)).load_state(folder / ATTACK_FOLDER / STATE_FILE)
    client = copy.deepcopy(knowledge.model)
    head = next(s for s in split_layers(knowledge.num_layers, config.cuts) if s.owner == "head")
    load_owner_state_dict(client, head, PrivateStore(folder / "clients" / "partition-0").load()["head"]["lora"])

    features = knowledge.features(knowledge.pixel_values(data.train_all))
    with torch.no_grad():
        rows = {name: torch.stack(visual_rows(model, features, knowledge.prefix_ids, knowledge.first_cut))
                for name, model in (("pilot", server.pilot), ("hijacked", client), ("before", knowledge.model))}
    gap = {name: float((rows[name] - rows["pilot"]).pow(2).mean()) for name in ("hijacked", "before")}
    print(gap)
    assert gap["hijacked"] < 0.6 * gap["before"]

    # The replay decodes with the networks the run saved, exactly as the run's server would: it
    # rebuilds them with the run's settings and loads them, training nothing.
    def no_training(self):
        raise AssertionError("the replay trained FSHA's networks instead of loading the run's")

    monkeypatch.setattr(FSHA, "_autoencoder_step", no_training)
    result = replay(folder, "fsha", options={"progress": False}, aux_limit=32)
    print(result.metrics)
    assert result.details["observed_samples"] == 20 * 16
    assert result.metrics["psnr"] > result.metrics["baseline_psnr"] + 1.0  # the mean public image's
    expected = server.run(Recording.open(folder)).outputs["reconstructions"]
    torch.testing.assert_close(result.outputs["reconstructions"], expected)


def test_a_resumed_hijack_goes_on_exactly_where_it_stopped(run_config, fake_grid):
    raw = run_config(**{"threat.model": "active-fsha", "train.rounds": 2, "train.steps_per_round": 2, **FAST_FSHA})
    straight = run(fake_grid(client_app, {**raw, "output.name": "straight"}, 2),
                   load_config({**raw, "output.name": "straight"}))
    first = {**raw, "train.rounds": 1}
    run(fake_grid(client_app, first, 2), load_config(first))
    resumed = run(fake_grid(client_app, raw, 2), load_config(raw))  # round 2 from round 1's checkpoint

    assert status(resumed)["resumed_from"] == 1
    got, want = (torch.load(f.path / ATTACK_FOLDER / STATE_FILE, weights_only=True) for f in (resumed, straight))
    for network in ("pilot", "decoder", "discriminator"):
        assert all(torch.equal(got[network][k], want[network][k]) for k in want[network])
    heads = [PrivateStore(f.path / "clients" / "partition-0").load()["head"]["lora"] for f in (resumed, straight)]
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[1])
