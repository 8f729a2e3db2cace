"""FSHA hijacks a client that trusts the server's gradients; an honest client's rows stay opaque to it."""

import torch

from attacks import build_attack
from attacks.knowledge import visual_rows

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
