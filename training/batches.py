"""Client-side data: tokenised samples, a deterministic batch order, decoder inputs.

The batch of step s is a function of (seed, s) alone, so a client that runs each
message in a fresh process rebuilds the very same batch to run a backward pass, and
nothing about which samples were used needs to leave it.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from pruning import PruningRecord, VisualTokenSelector
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
    marks: Mapping[str, Sequence[int]] = MappingProxyType({}),
) -> tuple[DecoderInputs, PruningRecord]:
    """Features -> kept tokens -> projector -> merged decoder inputs; also what pruning did."""
    visual, pruned = projected_visual_tokens(model, features, selector, batch, device, marks)
    inputs = merge_multimodal_inputs(
        model, [item.prompt_ids for item in batch], visual, answers, padding_side="left"
    )
    return inputs, pruned


def projected_visual_tokens(
    model: nn.Module,
    features: VisionFeatureCache,
    selector: VisualTokenSelector,
    batch: Sequence[EncodedSample],
    device: torch.device,
    marks: Mapping[str, Sequence[int]] = MappingProxyType({}),
) -> tuple[list[torch.Tensor], PruningRecord]:
    """Each sample's kept visual tokens through the projector, and what pruning did.

    `marks` maps a stamped image's id to the patches holding its mark (stamped benchmark).
    """
    samples = [item.sample for item in batch]
    stacked = features.stack(samples).to(device)
    selection = selector(stacked, samples)
    keep = selection.keep
    pruned = PruningRecord.of_batch(
        keep, stacked.shape[1], sensitivity=selection.sensitivity, marks=[marks.get(s.image_id, ()) for s in samples]
    )
    dtype = next(model.parameters()).dtype
    visual = [
        project_visual_features(model, stacked[i, indices].unsqueeze(0).to(dtype))[0] for i, indices in enumerate(keep)
    ]
    return visual, pruned
