"""ActInv recovers the question from the first cut's activations, unless they no longer carry it."""

import torch

from attacks import build_attack


def test_actinv_recovers_the_question_at_an_early_cut(knowledge, victims, aux, record_activations):
    recording, truth = record_activations(victims[:8])
    result = build_attack("actinv", knowledge, iterations=200, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["token_recall"] > 0.9
    assert result.metrics["rouge_l"] > 0.9


def test_actinv_fails_when_the_activations_are_replaced_by_noise(knowledge, victims, aux, record_activations):
    def noise(tensors):
        rows = tensors["rows"]
        return {**tensors, "rows": torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)) * rows.std()}

    recording, truth = record_activations(victims[:8], defense=noise)
    result = build_attack("actinv", knowledge, iterations=200, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["token_recall"] < 0.3


# -- adaptive: the masked cosine against defenses that zero elements ------------------------------

def test_the_masked_distance_ignores_elements_where_the_observed_row_is_zero(knowledge):
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(3, 16, generator=generator)
    target[target.abs() < 0.8] = 0  # about half the elements zeroed
    target[2] = 0  # a row the defense zeroed entirely
    out = torch.randn(3, 16, generator=generator)
    elsewhere = out.clone()
    elsewhere[target == 0] = 100 * torch.randn(int((target == 0).sum()), generator=generator)
    masked = build_attack("actinv", knowledge, mask_zeros=True)
    plain = build_attack("actinv", knowledge)
    assert torch.allclose(masked.distance(out, target), masked.distance(elsewhere, target))
    assert not torch.allclose(plain.distance(out, target)[:2], plain.distance(elsewhere, target)[:2])
    # On the observed support it is the plain cosine of the restricted vectors; a row with nothing observed scores 0.
    support = target[0] != 0
    expected = 1 - torch.nn.functional.cosine_similarity(out[0, support], target[0, support], dim=0)
    assert torch.isclose(masked.distance(out, target)[0], expected)
    assert masked.distance(elsewhere, target)[2] == 0
    # The row itself, whatever sits where it was zeroed, is at distance 0.
    assert torch.allclose(masked.distance(target + (target == 0) * 5.0, target)[:2], torch.zeros(2), atol=1e-6)


def test_masked_actinv_recovers_at_least_as_many_tokens_as_plain_on_sparsified_activations(
    knowledge, victims, aux, record_activations, defended_config, client_defense
):
    config = defended_config("sparsify", {"sparsify.ratio": 0.6})
    recording, truth = record_activations(victims[:8], defense=client_defense(config))
    zeros = float((recording.tensors(recording.entries[0])["rows"] == 0).float().mean())
    assert abs(zeros - 0.6) < 0.01  # the recording holds what the defense sent
    plain = build_attack("actinv", knowledge, iterations=200, progress=False).fit(aux).run(recording, truth)
    masked = build_attack("actinv", knowledge, iterations=200, mask_zeros=True, progress=False).fit(aux).run(
        recording, truth)
    print(plain.metrics, masked.metrics)
    assert masked.metrics["token_recall"] >= plain.metrics["token_recall"]
    assert masked.metrics["token_recall"] > 0.9


def test_masked_actinv_beats_plain_against_pripert_l0(knowledge, victims, aux, record_activations, defended_config,
                                                      client_defense):
    """PriPert-L0 zeroes the elements that move an inversion most, not the smallest: the plain cosine
    is pulled towards those zeros, the masked one is not. The gain comes from the refinement, which
    scores candidates with the same masked distance (plain projection alone does worse here)."""
    config = defended_config("pripert", {"pripert.variant": "l0", "pripert.sparsity": 0.7})
    recording, truth = record_activations(victims[:8], defense=client_defense(config))
    plain = build_attack("actinv", knowledge, iterations=200, progress=False).fit(aux).run(recording, truth)
    masked = build_attack("actinv", knowledge, iterations=200, mask_zeros=True, progress=False).fit(aux).run(
        recording, truth)
    print(plain.metrics, masked.metrics)
    assert masked.metrics["token_recall"] >= plain.metrics["token_recall"] + 0.08
