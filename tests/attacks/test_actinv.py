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
