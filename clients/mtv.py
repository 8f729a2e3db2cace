"""Federated DP-MTV on a client (paradigm mtv): nothing is trained; the client's private rows become
its share of the task vector's chunks (privacy.dp_mtv).

- `share`: its chunks (its share of privacy.mtv.chunks, K demonstrations and a target each, drawn
  from its own training rows), read at the heads' last token, clipped per layer and summed; under
  distributed noise, its share of the release's noise added before the sum leaves.
- `selection_scores`: private head selection's counts over the candidate masks the released values
  give (each of its chunks adds 0 or 1 to a mask's count).
- `evaluate`: its test share answered zero-shot and with the released task vector.

The chunks are a seeded draw of (privacy.seed, partition), so every message rebuilds the same ones
without keeping state between them.
"""

import torch

from clients.runtime import ClientRuntime
from privacy import OptionError
from privacy.dp_mtv import (
    DISTRIBUTED,
    candidate_masks,
    client_chunks,
    clipped_sum,
    noise_share,
    private_selection_scores,
)
from training import protocol
from vlm.answering import answer_questions
from vlm.task_vectors import HeadLayout, chunk_activations, head_layout, replaced_heads
from vqa import VQASample, score_sample


def own_chunks(rt: ClientRuntime) -> list[list[VQASample]]:
    """This client's chunks: its share of privacy.mtv.chunks, disjoint, from its own training rows."""
    options, samples = rt.config.privacy.mtv, [item.sample for item in rt.train]
    try:
        indices = client_chunks(options, rt.config.clients.count, rt.partition_id, len(samples), rt.config.privacy.seed)
    except OptionError as error:
        raise ValueError(f"privacy.mtv.{error.option}={getattr(options, error.option)!r} cannot be served by client "
                         f"{rt.partition_id} with {len(samples)} training rows: {error.allowed}") from None
    return [[samples[index] for index in chunk] for chunk in indices]


def layout(rt: ClientRuntime) -> HeadLayout:
    return head_layout(rt.model, rt.config.privacy.mtv.layer_indices)


@torch.no_grad()
def share(rt: ClientRuntime) -> tuple[torch.Tensor, int]:
    """The sum of this client's clipped chunk activations [layers, heads, head_dim] (noised by its
    share under distributed noise), and its chunk count."""
    options = rt.config.privacy.mtv
    chunks = own_chunks(rt)
    activations = chunk_activations(rt.model, rt.tokenizer, rt.features, chunks, layout(rt),
                                    instruction=rt.party.instruction, progress=False)
    total, _ = clipped_sum(activations, options)
    if options.noise == DISTRIBUTED and options.private:
        generator = rt.defenses.seed_for(rt.partition_id, 1, 0).generator("mtv-noise")
        total = total + noise_share(options, total.shape, rt.config.clients.count, generator)
    return total, len(chunks)


def selection_scores(rt: ClientRuntime, values: torch.Tensor) -> torch.Tensor:
    """Per candidate mask of the released `values` (privacy.dp_mtv.candidate_masks, in order), the
    chunks of this client whose target's answer it makes more likely than zero-shot."""
    targets = [chunk[-1] for chunk in own_chunks(rt)]
    scores = private_selection_scores(rt.model, rt.tokenizer, rt.features, targets, layout(rt), values,
                                      candidate_masks(values), instruction=rt.party.instruction)
    return torch.tensor(scores, dtype=torch.int64)


def evaluate(rt: ClientRuntime, values: torch.Tensor, mask: torch.Tensor) -> dict:
    """The test share scored with the task vector (ClientRuntime.test_scores) and zero-shot (summed
    and per question: the vector's gain, question by question)."""
    samples = [item.sample for item in rt.test]
    config = rt.config.eval

    def scores(intervention=None) -> list[float]:
        answers = answer_questions(rt.model, rt.tokenizer, rt.features, samples, instruction=rt.party.instruction,
                                   intervention=intervention, batch_size=config.batch_size,
                                   max_new_tokens=config.max_new_tokens, progress=False)
        return [float(score_sample(answer, sample)) for answer, sample in zip(answers, samples, strict=True)]

    vector = layout(rt)
    metrics = rt.test_scores(0, scores(lambda: replaced_heads(rt.model, vector, values, mask.bool())))
    zero_shot = scores()
    return {**metrics, "zero_shot_correct": sum(zero_shot), protocol.ZERO_SHOT_SCORES: zero_shot}
