"""Client-side data: tokenised samples, a deterministic batch order, decoder inputs.

The batch of step s is a function of (seed, s) alone, so a client that runs each
message in a fresh process rebuilds the very same batch to run a backward pass, and
nothing about which samples were used needs to leave it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from pruning import VisualTokenSelector
from vlm.features import VisionFeatureCache
from vlm.segments import DecoderInputs, merge_multimodal_inputs, project_visual_features
from vqa import VQASample, build_prompt


@dataclass(frozen=True)
class EncodedSample:
    sample: VQASample
    prompt_ids: torch.Tensor
    # Answer tokens followed by end-of-sequence: what the loss trains.
    answer_ids: torch.Tensor


def encode_samples(
    samples: Sequence[VQASample], tokenizer: PreTrainedTokenizerBase, instruction: str | None
) -> list[EncodedSample]:
    encoded = []
    for sample in samples:
        prompt = tokenizer(build_prompt(sample.question, instruction=instruction), add_special_tokens=False)
        answer = tokenizer(" " + sample.answer, add_special_tokens=False)
        encoded.append(
            EncodedSample(
                sample=sample,
                prompt_ids=torch.tensor(prompt["input_ids"], dtype=torch.long),
                answer_ids=torch.tensor([*answer["input_ids"], tokenizer.eos_token_id], dtype=torch.long),
            )
        )
    return encoded


def batch_positions(num_samples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of step `step`'s batch: epochs of seeded permutations, read in order."""
    positions = []
    for slot in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(slot, num_samples)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        positions.append(int(torch.randperm(num_samples, generator=generator)[offset]))
    return positions


def decoder_inputs(
    model: nn.Module,
    features: VisionFeatureCache,
    selector: VisualTokenSelector,
    batch: Sequence[EncodedSample],
    answers: Sequence[torch.Tensor] | None,
    device: torch.device,
) -> tuple[DecoderInputs, list[int]]:
    """Features -> kept tokens -> projector -> merged decoder inputs; also each sample's kept count."""
    visual, kept = projected_visual_tokens(model, features, selector, batch, device)
    inputs = merge_multimodal_inputs(
        model, [item.prompt_ids for item in batch], visual, answers, padding_side="left"
    )
    return inputs, kept


def projected_visual_tokens(
    model: nn.Module,
    features: VisionFeatureCache,
    selector: VisualTokenSelector,
    batch: Sequence[EncodedSample],
    device: torch.device,
) -> tuple[list[torch.Tensor], list[int]]:
    """Each sample's kept visual tokens through the projector, and how many were kept."""
    stacked = features.stack([item.sample for item in batch]).to(device)
    keep = selector(stacked, [item.sample for item in batch])
    dtype = next(model.parameters()).dtype
    visual = [
        project_visual_features(model, stacked[i, indices].unsqueeze(0).to(dtype))[0] for i, indices in enumerate(keep)
    ]
    return visual, [int(indices.numel()) for indices in keep]
