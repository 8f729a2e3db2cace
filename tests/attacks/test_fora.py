"""FORA inverts undefended visual rows better than the mean image, and not rows of another image."""

import copy

import torch

from attacks import build_attack
from attacks.knowledge import split_packed
from vlm.lora import decoder_layer_index, lora_parameters

FAST = {"substitute_steps": 30, "decoder_steps": 400, "decoder_width": 64, "progress": False}


def swap_images_within_batch(knowledge):
    """A 'defense' that sends each sample's visual rows under its neighbour's text: the rows keep
    their distribution but no longer show the sample's own image."""
    prefix, visual = knowledge.prefix_ids.numel(), knowledge.num_patches

    def defense(tensors):
        samples = [rows.clone() for rows in split_packed(tensors["rows"], tensors["lengths"])]
        images = [rows[prefix : prefix + visual].clone() for rows in samples]
        for i, rows in enumerate(samples):
            rows[prefix : prefix + visual] = images[(i + 1) % len(samples)]
        return {**tensors, "rows": torch.cat(samples)}

    return defense


def test_fora_beats_the_mean_image_when_nothing_is_defended(knowledge, victims, aux, record_activations):
    recording, truth = record_activations(victims[:32])
    result = build_attack("fora", knowledge, **FAST).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["psnr"] > result.metrics["baseline_psnr"] + 2.0
    assert result.metrics["ssim"] > result.metrics["baseline_ssim"]
    assert result.outputs["reconstructions"].shape == (32, 3, knowledge.image_size, knowledge.image_size)


def test_fora_does_no_better_than_the_mean_image_when_the_rows_show_another_image(
    knowledge, victims, aux, record_activations
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
