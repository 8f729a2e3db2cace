"""FORA inverts undefended visual rows better than the mean image, and not rows of another image."""

import copy
import dataclasses

import pytest
import torch

from attacks import build_attack
from attacks.context import ReplayContext
from config import load_config
from privacy.edge import edge_vision_tokens
from pruning import RatioOptions, build_policy
from pruning.policies import PolicyContext
from training.defenses import build_defenses, describe_defenses
from vlm.lora import decoder_layer_index, lora_parameters

FAST = {"substitute_steps": 30, "decoder_steps": 400, "decoder_width": 64, "progress": False}


def test_fora_beats_the_mean_image_when_nothing_is_defended(knowledge, victims, aux, record_activations):
    recording, truth = record_activations(victims[:32])
    result = build_attack("fora", knowledge, **FAST).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["psnr"] > result.metrics["baseline_psnr"] + 2.0
    assert result.metrics["ssim"] > result.metrics["baseline_ssim"]
    assert result.outputs["reconstructions"].shape == (32, 3, knowledge.image_size, knowledge.image_size)


def test_fora_does_no_better_than_the_mean_image_when_the_rows_show_another_image(
    knowledge, victims, aux, record_activations, swap_images_within_batch
):
    recording, truth = record_activations(victims[:32], defense=swap_images_within_batch(knowledge))
    result = build_attack("fora", knowledge, **FAST).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["psnr"] < result.metrics["baseline_psnr"] + 0.5


def test_fora_substitute_follows_a_client_whose_private_adapters_moved(knowledge, victims, aux, record_activations):
    """The victim's head LoRA has drifted from the public weights (as after training): fitting the
    substitute to the observed rows must recover more than inverting as if nothing had moved."""
    victim = copy.deepcopy(knowledge.model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in lora_parameters(victim).items():
            if "lora_B" in name and decoder_layer_index(name) < knowledge.first_cut:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    recording, truth = record_activations(victims[:32], model=victim)
    fitted = build_attack("fora", knowledge, **{**FAST, "substitute_steps": 300}).fit(aux).run(recording, truth)
    unfitted = build_attack("fora", knowledge, **{**FAST, "substitute_steps": 0}).fit(aux).run(recording, truth)
    print(fitted.metrics, unfitted.metrics)
    assert fitted.metrics["psnr"] > unfitted.metrics["psnr"] + 1.0


def test_fora_runs_against_a_bf16_model(knowledge, victims, aux, record_activations):
    """The paper's run computes in bf16 (on a GPU): the substitute's rows meet FORA's own float32
    networks and the float32 observations on the CPU."""
    bf16 = dataclasses.replace(knowledge, model=copy.deepcopy(knowledge.model).to(torch.bfloat16))
    recording, truth = record_activations(victims[:8])
    result = build_attack("fora", bf16, **{**FAST, "substitute_steps": 2, "decoder_steps": 2}).fit(aux[:16]).run(
        recording, truth)
    reconstructions = result.outputs["reconstructions"]
    assert reconstructions.shape == (8, 3, bf16.image_size, bf16.image_size) and torch.isfinite(reconstructions).all()


# -- adaptive: the inverse network trained on defended rows ----------------------------------------

def zero_shares(grid: torch.Tensor) -> torch.Tensor:
    return (grid == 0).flatten(1).float().mean(-1)


@pytest.mark.parametrize("defenses, options, share", [
    ("sparsify", {"sparsify.ratio": 0.6}, 0.6),
    ("pripert", {"pripert.variant": "l0", "pripert.sparsity": 0.5, "pripert.iterations": 4}, 0.5),
])
def test_adaptive_fora_trains_its_inverse_network_on_rows_through_the_runs_defense(
    knowledge, aux, tmp_path, defended_config, defenses, options, share
):
    config = defended_config(defenses, options)
    adaptive = build_attack("fora", knowledge, adaptive=True, batch_size=8, progress=False)
    adaptive.prepare_replay(ReplayContext(tmp_path, config, knowledge))
    adaptive.fit(aux[:16])
    plain = build_attack("fora", knowledge, batch_size=8, progress=False).fit(aux[:16])
    plain.prepare_replay(ReplayContext(tmp_path, config, knowledge))
    n, width = knowledge.num_patches, knowledge.hidden_size
    exact = round(share * n * width) / (n * width)
    # Each auxiliary image's visual rows are one sample: exactly the configured share of its elements is zero.
    assert adaptive.adapted_to == [defenses]
    assert torch.equal(zero_shares(adaptive.inverse_training_rows(knowledge.model, [n])), torch.full((16,), exact))
    assert zero_shares(plain.inverse_training_rows(knowledge.model, [n])).max() == 0


def test_adaptive_fora_replays_on_a_defended_recording_training_on_defended_rows(
    knowledge, victims, aux, record_activations, defended_config, client_defense, monkeypatch
):
    """The run's defenses from the recording's header, the decoder's training inputs defended, and
    the same attack without the header refused."""
    config = defended_config("sparsify", {"sparsify.ratio": 0.6})
    recording, truth = record_activations(victims[:16], defense=client_defense(config),
                                          defenses=describe_defenses(config))
    attack = build_attack("fora", knowledge, adaptive=True, substitute_steps=5, decoder_steps=20, decoder_width=32,
                          batch_size=8, progress=False).fit(aux[:32])
    seen = []
    inputs = attack.inverse_training_rows
    monkeypatch.setattr(attack, "inverse_training_rows", lambda *a, **kw: seen.append(inputs(*a, **kw)) or seen[-1])
    result = attack.run(recording, truth)
    assert result.details["adaptive_to"] == ["sparsify"]
    n, width = knowledge.num_patches, knowledge.hidden_size
    assert torch.equal(zero_shares(seen[0]), torch.full((32,), round(0.6 * n * width) / (n * width)))
    assert result.outputs["reconstructions"].shape[0] == 16

    bare, _ = record_activations(victims[:8], defense=client_defense(config), name="no-header")
    with pytest.raises(ValueError, match="adaptive=True re-applies the run's defenses"):
        build_attack("fora", knowledge, adaptive=True, substitute_steps=1, decoder_steps=1, progress=False).fit(
            aux[:8]).run(bare)


def test_adaptive_fora_simulates_the_run_s_edge_so_as_many_rows_survive_as_a_client_sent(
    knowledge, aux, tmp_path, defended_config
):
    """Through an edge that drops tokens (and sparsification after it), the attacker's keep sets are
    larger than the observed count by the share the edge leaves: what survives its copy of the edge is
    as many rows per image as the client sent, each sparsified as the client's were."""
    config = defended_config("drop,sparsify", {"drop.r": 4, "sparsify.ratio": 0.6})
    attack = build_attack("fora", knowledge, adaptive=True, batch_size=8, progress=False)
    attack.prepare_replay(ReplayContext(tmp_path, config, knowledge))
    attack.fit(aux[:16])
    assert attack.adapted_to == ["drop", "sparsify"]
    chain = build_defenses(config)
    sent = edge_vision_tokens(knowledge.model, knowledge.pixel_values(aux[:1]), chain, chain.seed_for(0, 0, 1))
    observed = sent.tokens[0].shape[0]
    assert observed < knowledge.num_patches
    grid = attack.inverse_training_rows(knowledge.model, [observed])
    rows_per_image = (grid != 0).any(-1).sum(-1)
    assert torch.equal(rows_per_image, torch.full((16,), observed))
    width = knowledge.hidden_size
    assert torch.equal(zero_shares(grid[:, (grid[0] != 0).any(-1)]),
                       torch.full((16,), round(0.6 * observed * width) / (observed * width)))


def test_a_policy_aware_fora_learns_from_the_rows_the_runs_policy_keeps(knowledge, aux, monkeypatch):
    attack = build_attack("fora", knowledge, **{**FAST, "substitute_steps": 2, "decoder_steps": 2,
                                                "policy_aware": True}).fit(aux[:24])
    attack.run_config = load_config({"output.name": "f", "model.profile": "tiny", "pruning.policy": "random",
                                     "pruning.ratio": 0.75})
    used = []
    rows = attack._rows
    monkeypatch.setattr(attack, "_rows", lambda model, batch, keep: used.append((batch, keep)) or rows(model, batch, keep))
    attack.reconstruct([torch.randn(4, knowledge.hidden_size) for _ in range(3)])
    policy = build_policy("random", PolicyContext(profile="tiny", options=RatioOptions(0.75)))
    expected = policy(attack.aux_features, attack.aux).keep
    # Both the substitute's batches and the inverse network's rows come from the policy's keep sets.
    assert len(used) == 3
    assert all(torch.equal(kept, expected[int(i)]) for batch, keep in used for i, kept in zip(batch, keep, strict=True))
