"""DP-MTV's mechanism: disjoint chunks, per-layer clipping, noise at the calibrated scale, the
exponential mechanism's odds, and a ledger that private selection charges and queries never move."""

import math

import dp_accounting
import pytest
import torch

from privacy.base import OptionError
from privacy.dp_mtv import (
    PRIVATE,
    DPMTVOptions,
    PrivacyLedger,
    build_task_vector,
    candidate_masks,
    clip_per_layer,
    disjoint_chunks,
    chunk_counts,
    clipped_sum,
    exponential_mechanism,
    noise_share,
    release_sum,
    release_task_vector,
    sum_noise_std,
)
from vlm.answering import answer_questions
from vlm.profiles import TINY


def test_chunks_are_disjoint_seeded_and_as_many_as_asked():
    options = DPMTVOptions(chunks=7, shots=3)
    chunks = disjoint_chunks(40, options, seed=0)
    flat = [index for chunk in chunks for index in chunk]
    assert len(chunks) == 7 and all(len(chunk) == 4 for chunk in chunks)
    assert len(set(flat)) == len(flat) and set(flat) <= set(range(40))
    assert chunks == disjoint_chunks(40, options, seed=0) and chunks != disjoint_chunks(40, options, seed=1)


@pytest.mark.parametrize(("options", "examples", "message"), [
    (DPMTVOptions(chunks=0), None, "chunks=0 is not allowed; allowed: >= 1"),
    (DPMTVOptions(clip=0.0), None, "clip=0.0 is not allowed"),
    (DPMTVOptions(epsilon=0.0), None, "epsilon=0.0 is not allowed; allowed: > 0"),
    (DPMTVOptions(delta=1.0), None, "delta=1.0"),
    (DPMTVOptions(selection="greedy"), None, "selection='greedy' is not allowed; allowed: public"),
    (DPMTVOptions(selection=PRIVATE, selection_epsilon=0.0), None, "selection_epsilon=0.0"),
    (DPMTVOptions(layers="3,1"), None, "layers='3,1'"),
    (DPMTVOptions(layers="2,x"), None, "layers='2,x'"),
    (DPMTVOptions(noise="local"), None, "noise='local'.*central"),
    (DPMTVOptions(chunks=11, shots=3), 40, "chunks=11 is not allowed; allowed: at most 10: 11 chunks of 3 "
                                            "demonstrations and a target need 44 examples, the private set has 40"),
    (DPMTVOptions(chunks=4, delta=0.05), 40, "delta=0.05 is not allowed; allowed: < 1/40"),
])
def test_bad_options_are_refused_naming_the_option(options, examples, message):
    with pytest.raises(OptionError, match=message):
        options.validate(examples)


def test_clipping_bounds_each_chunks_norm_at_each_layer_and_leaves_small_ones():
    activations = torch.randn(6, 3, 2, 4, generator=torch.Generator().manual_seed(0))
    activations[0, 0] *= 0.01
    clipped, share = clip_per_layer(activations, clip=1.0)
    norms = clipped.flatten(2).norm(dim=-1)
    assert (norms <= 1.0 + 1e-6).all()
    torch.testing.assert_close(clipped[0, 0], activations[0, 0])
    assert share == pytest.approx(float((activations.flatten(2).norm(dim=-1) > 1).float().mean()))


def test_the_noise_has_the_scale_the_accountant_calibrates():
    options = DPMTVOptions(chunks=16, clip=2.0, epsilon=1.0, delta=1e-5)
    layers = 3
    std = sum_noise_std(options, layers) / options.chunks
    sigma = std / (math.sqrt(layers) * options.clip / options.chunks)
    # The release at this std spends exactly the options' budget by the analytic Gaussian mechanism.
    assert dp_accounting.get_epsilon_gaussian(sigma, options.delta) == pytest.approx(options.epsilon, rel=1e-6)
    ledger = PrivacyLedger()
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([release_task_vector(torch.zeros(16, layers, 4, 8), options, generator, ledger)[0]
                         for _ in range(200)])
    assert draws.std().item() == pytest.approx(std, rel=0.03)
    assert draws.mean().abs().item() < 3 * std / math.sqrt(draws.numel())
    assert ledger.epsilon == pytest.approx(200 * options.epsilon)


def test_clients_sums_add_up_to_the_central_clipped_mean_and_their_noise_shares_to_its_noise():
    options = DPMTVOptions(chunks=10, clip=1.0, epsilon=1.0, delta=1e-5)
    activations = torch.randn(10, 3, 4, 8)
    counts = chunk_counts(options.chunks, 3)
    assert counts == [4, 3, 3]
    parts = torch.split(activations, counts)
    total = sum(clipped_sum(part, options)[0] for part in parts)
    clipped, _ = clip_per_layer(activations, options.clip)
    torch.testing.assert_close(total / options.chunks, clipped.mean(0))
    # Three clients' shares of the noise sum to the std one aggregator would draw.
    draws = torch.stack([noise_share(options, (3, 20000), 3, torch.Generator().manual_seed(client)) for client in range(3)])
    assert draws.sum(0).std().item() == pytest.approx(sum_noise_std(options, 3), rel=0.03)
    # All of it arrived: charged at ε; a third missing: charged at the larger ε two thirds of the variance give.
    for share, charged in ((1.0, lambda e: e == pytest.approx(1.0)), (2 / 3, lambda e: e > 1.0)):
        ledger = PrivacyLedger()
        values, std = release_sum(total, options.chunks, options, torch.Generator(), ledger, clients_noise_share=share)
        torch.testing.assert_close(values, total / options.chunks)  # the clients' noise is already in the sum
        assert charged(ledger.epsilon) and std == pytest.approx(sum_noise_std(options, 3) / options.chunks * math.sqrt(share))


def test_non_private_mtv_is_the_plain_mean():
    activations = torch.randn(5, 2, 2, 3, generator=torch.Generator().manual_seed(0)) * 10
    ledger = PrivacyLedger()
    values, report = release_task_vector(activations, DPMTVOptions(chunks=5, epsilon=math.inf), torch.Generator(), ledger)
    torch.testing.assert_close(values, activations.mean(0))
    assert ledger.epsilon == math.inf and report["noise_std"] == 0.0


def test_the_exponential_mechanism_has_its_odds():
    generator = torch.Generator().manual_seed(0)
    picks = [exponential_mechanism([0.0, 1.0], epsilon=1.0, sensitivity=1.0, generator=generator) for _ in range(20000)]
    # P(1) / P(0) = exp(ε · Δscore / (2 · sensitivity)) = e^0.5.
    assert sum(picks) / len(picks) == pytest.approx(math.exp(0.5) / (1 + math.exp(0.5)), abs=0.015)
    assert exponential_mechanism([0.0, 3.0, 1.0], epsilon=1e4, sensitivity=1.0, generator=generator) == 1


def test_candidates_are_each_layer_all_heads_and_the_largest_released_heads():
    vector = torch.zeros(4, 2, 3)
    vector[2, 1] = 5.0
    masks = candidate_masks(vector)
    assert all(mask.shape == (4, 2) for mask in masks)
    assert any(mask.sum() == 1 and mask[2, 1] for mask in masks)
    assert any(mask.all() for mask in masks)
    assert len({mask.numpy().tobytes() for mask in masks}) == len(masks)


@pytest.mark.parametrize("selection", ["public", PRIVATE])
def test_a_task_vector_costs_its_release_and_selection_and_queries_cost_nothing(tiny_answerer, selection):
    model, tokenizer, features, samples = tiny_answerer
    options = DPMTVOptions(chunks=8, shots=2, clip=1.0, epsilon=2.0, delta=1e-3, selection=selection,
                           selection_epsilon=0.5, reinforce_steps=2)
    vector = build_task_vector(model, tokenizer, features, samples[:40], samples[40:], options,
                               instruction=None, seed=0, progress=False)
    expected = 2.0 + (0.5 if selection == PRIVATE else 0.0)
    assert vector.ledger.epsilon == pytest.approx(expected)
    assert vector.values.shape == (TINY.num_layers, 2, TINY.hidden_size // 2)
    before = vector.ledger.to_dict()
    for _ in range(3):
        answer_questions(model, tokenizer, features, samples[40:], instruction=None, max_new_tokens=2,
                         intervention=vector.intervention(model), progress=False)
    assert vector.ledger.to_dict() == before
