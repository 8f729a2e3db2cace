"""FSHA hijacks a client that trusts the server's gradients; an honest client's rows stay opaque to it."""

from types import SimpleNamespace

import torch
from torch.nn import functional as F

from attacks import build_attack
from attacks.adaptive import AttackerDefense
from attacks.context import ReplayContext
from attacks.knowledge import visual_rows
from config import load_config
from pruning import RatioOptions, build_policy, keep_count
from pruning.policies import PolicyContext
from strategies.adversarial import FSHAHijack
from training.defenses import build_defenses
from training.model import load_party_model
from vlm.profiles import TINY

FAST = {"pretrain_steps": 200, "discriminator_steps": 3, "decoder_width": 32, "progress": False}


def test_fsha_inverts_the_hijacked_client_but_not_an_honest_one(knowledge, victims, aux, record_activations):
    attack = build_attack("fsha", knowledge, **FAST).fit(aux)
    client = knowledge.trainable_front()
    attack.simulate_hijack(client, victims, steps=200, client_lr=3e-3)

    # The hijack moved the client's rows towards the pilot's for the same private images.
    features = knowledge.features(knowledge.pixel_values(victims[:32]))
    with torch.no_grad():
        rows = {name: torch.stack(visual_rows(model, features, knowledge.prefix_ids, knowledge.first_cut))
                for name, model in (("pilot", attack.pilot), ("hijacked", client), ("honest", knowledge.model))}
    gap = {name: float((rows[name] - rows["pilot"]).pow(2).mean()) for name in ("hijacked", "honest")}

    hijacked, truth = record_activations(victims[:32], model=client, name="hijacked")
    honest, honest_truth = record_activations(victims[:32], name="honest")
    on_hijacked = attack.run(hijacked, truth).metrics
    on_honest = attack.run(honest, honest_truth).metrics
    print(gap, on_hijacked, on_honest)
    assert gap["hijacked"] < 0.7 * gap["honest"]
    assert on_hijacked["psnr"] > on_hijacked["baseline_psnr"] + 0.5
    assert on_honest["psnr"] < on_honest["baseline_psnr"] - 3.0


def test_fsha_answers_a_packed_activation_with_gradients_on_its_visual_rows_only(knowledge, victims, aux,
                                                                                  record_activations):
    attack = build_attack("fsha", knowledge, **{**FAST, "pretrain_steps": 1}).fit(aux)
    recording, _ = record_activations(victims[:4], batch_size=4)
    tensors = recording.tensors(recording.entries[0])
    grad = attack.gradients_for_packed(tensors["rows"], tensors["lengths"])
    assert grad.shape == tensors["rows"].shape
    prefix, visual = knowledge.prefix_ids.numel(), knowledge.num_patches
    start = 0
    for length in tensors["lengths"].tolist():
        sample = grad[start : start + length]
        assert sample[prefix : prefix + visual].abs().sum(-1).gt(0).all()
        assert sample[:prefix].abs().sum() == 0 and sample[prefix + visual :].abs().sum() == 0
        start += length


def test_adaptive_fsha_fine_tunes_only_its_decoder_on_defended_pilot_rows(knowledge, aux, tmp_path, defended_config):
    """At replay time, after the run's hijack state loads: the decoder learns to invert the pilot's rows
    through the run's defense; pilot, discriminator and the hijack's generator stay as the run left them."""
    run = build_attack("fsha", knowledge, **{**FAST, "pretrain_steps": 30}).fit(aux[:64])
    (tmp_path / "attacks").mkdir()
    run.save_state(tmp_path / "attacks" / "fsha.pt")
    saved = run.state_dict()
    config = defended_config("sparsify", {"sparsify.ratio": 0.6})

    def replayed(**options):
        attack = build_attack("fsha", knowledge, **FAST, **options)
        attack.prepare_replay(ReplayContext(tmp_path, config, knowledge))
        return attack.fit(aux[:64])

    plain, adaptive = replayed(), replayed(adaptive=True, adaptive_steps=60)
    assert plain.adapted_to is None and adaptive.adapted_to == ["sparsify"]
    state = adaptive.state_dict()
    for name, value in saved["pilot"].items():
        assert torch.equal(state["pilot"][name], value)
    for name, value in saved["discriminator"].items():
        assert torch.equal(state["discriminator"][name], value)
    assert torch.equal(state["generator"], saved["generator"])
    assert any(not torch.equal(state["decoder"][name], value) for name, value in saved["decoder"].items())

    # On the pilot's defended rows of the auxiliary images, the adapted decoder does better than the run's.
    defense = AttackerDefense(knowledge, build_defenses(config), seed=99)
    features, images = adaptive.aux_features[:32], adaptive.aux_images[:32]
    with torch.no_grad():
        rows = torch.stack(defense.visual_rows(adaptive.pilot, features)).float()
        error = {name: float(F.mse_loss(attack.reconstruct(list(rows)), images))
                 for name, attack in (("plain", plain), ("adaptive", adaptive))}
    print(error)
    assert error["adaptive"] < 0.8 * error["plain"]


def test_a_policy_aware_pilot_learns_from_the_rows_the_runs_policy_keeps(knowledge, aux):
    """The pilot's public rows are pruned as the clients' policy prunes, and spread over the grid
    as the clients' pruned rows are, for the autoencoder and the discriminator alike."""
    attack = build_attack("fsha", knowledge, **{**FAST, "pretrain_steps": 1, "policy_aware": True})
    attack.run_config = load_config({"output.name": "f", "model.profile": "tiny", "pruning.policy": "random",
                                     "pruning.ratio": 0.75})
    attack.fit(aux[:24])
    expected = build_policy("random", PolicyContext(profile="tiny", options=RatioOptions(0.75)))(
        attack.aux_features, attack.aux).keep
    assert all(torch.equal(kept, wanted) for kept, wanted in zip(attack.policy_keep, expected, strict=True))
    batch = torch.arange(4)
    with torch.no_grad():
        grid = attack._pilot_rows(batch)
    kept = len(expected[0])
    assert grid.shape[:2] == (4, knowledge.num_patches)
    assert ((grid.abs().sum(-1) > 0).sum(-1) == kept).all()
    # Without the policy: every visual token, in place.
    plain = build_attack("fsha", knowledge, **{**FAST, "pretrain_steps": 1}).fit(aux[:24])
    assert plain.policy_keep is None and (plain._pilot_rows(batch).abs().sum(-1) > 0).all()


def test_a_hijacking_server_told_to_know_the_policy_prunes_its_pilots_images(tmp_path):
    config = load_config({"output.name": "h", "output.root": str(tmp_path), "model.profile": "tiny",
                          "paradigm": "usl", "threat.model": "active-fsha", "threat.fsha_policy_aware": True,
                          "threat.aux_limit": 16, "data.train_limit": 16, "data.test_limit": 8,
                          "pruning.policy": "random", "pruning.ratio": 0.5})
    hijack = FSHAHijack(config, load_party_model(config), SimpleNamespace(path=tmp_path), pretrain=False)
    assert {len(kept) for kept in hijack.attack.policy_keep} == {keep_count(0.5, TINY.num_patches, 1)}
