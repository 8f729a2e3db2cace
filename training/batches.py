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

from config import SimConfig
from privacy import EDGE, DefenseChain, DefenseSeed
from privacy.dp import SGD
from privacy.edge import edge_vision_tokens, select_sent
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


def sampled_positions(num_samples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of step `step`'s batch drawn afresh: `batch_size` of the samples without
    replacement, independently of every other step (DP-SGD's sampling, privacy.dp_sgd)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * step + 1)
    return sorted(int(i) for i in torch.randperm(num_samples, generator=generator)[:batch_size])


def train_positions(config: SimConfig, num_samples: int, step: int) -> list[int]:
    """A client's training batch at `step`: epochs of a shuffle, or DP-SGD's independent draws."""
    draw = sampled_positions if config.privacy.dp.mode == SGD else batch_positions
    return draw(num_samples, config.train.batch_size, step, config.model.seed)


@dataclass(frozen=True)
class VisionEdge:
    """The EDGE defenses of a client's vision tower and the seed of this batch's draws."""

    defenses: DefenseChain
    seed: DefenseSeed


@dataclass(frozen=True)
class SentVisualRows:
    """Per sample, the vision rows [n, Dv] that go on to the projector, in their order, and the
    patch each stands for; with what pruning did."""

    rows: list[torch.Tensor]
    positions: list[torch.Tensor]
    pruned: PruningRecord


def decoder_inputs(
    model: nn.Module,
    features: VisionFeatureCache,
    selector: VisualTokenSelector,
    batch: Sequence[EncodedSample],
    answers: Sequence[torch.Tensor] | None,
    device: torch.device,
    marks: Mapping[str, Sequence[int]] = MappingProxyType({}),
    edge: VisionEdge | None = None,
) -> tuple[DecoderInputs, PruningRecord]:
    """Features -> kept tokens -> projector -> merged decoder inputs; also what pruning did."""
    visual, pruned = projected_visual_tokens(model, features, selector, batch, device, marks, edge)
    inputs = merge_multimodal_inputs(
        model, [item.prompt_ids for item in batch], visual, answers, padding_side="left"
    )
    return inputs, pruned


def sent_visual_rows(
    model: nn.Module,
    features: VisionFeatureCache,
    selector: VisualTokenSelector,
    samples: Sequence[VQASample],
    device: torch.device,
    marks: Mapping[str, Sequence[int]] = MappingProxyType({}),
    edge: VisionEdge | None = None,
) -> SentVisualRows:
    """The selector's keep set over the cached (undefended) features; with EDGE defenses, the
    edge's tokens whose position it keeps (privacy.edge), else the kept features in patch order.
    The attacks' truth calls this too, so it scores against the rows the client sent.

    `marks` maps a stamped image's id to the patches holding its mark (stamped benchmark).
    """
    stacked = features.stack(samples).to(device)
    selection = selector(stacked, samples)
    patches = stacked.shape[1]
    if edge is not None and edge.defenses.acts_at(EDGE):
        pixel_values = features.preprocess_images([sample.image for sample in samples]).to(device)
        output = edge_vision_tokens(model, pixel_values.to(stacked.dtype), edge.defenses, edge.seed)
        rows, positions = select_sent(output, selection.keep, patches)
    else:
        positions = list(selection.keep)
        rows = selection.rows(stacked)
    pruned = PruningRecord.of_batch(
        positions, patches, sensitivity=selection.sensitivity, marks=[marks.get(s.image_id, ()) for s in samples],
        sources=selection.sources(),
    )
    return SentVisualRows(rows, positions, pruned)


def projected_visual_tokens(
    model: nn.Module,
    features: VisionFeatureCache,
    selector: VisualTokenSelector,
    batch: Sequence[EncodedSample],
    device: torch.device,
    marks: Mapping[str, Sequence[int]] = MappingProxyType({}),
    edge: VisionEdge | None = None,
) -> tuple[list[torch.Tensor], PruningRecord]:
    """Each sample's sent visual rows through the projector, and what pruning did."""
    sent = sent_visual_rows(model, features, selector, [item.sample for item in batch], device, marks, edge)
    dtype = next(model.parameters()).dtype
    visual = [project_visual_features(model, rows.unsqueeze(0).to(dtype))[0] for rows in sent.rows]
    return visual, sent.pruned
