"""What an attacker may know besides the recording: the public model, the protocol, public data.

The threat model (SPEC.md §1) gives the server the public checkpoint (frozen base
weights: vision tower, projector, embeddings, decoder, LM head), the tokenizer and
prompt template, and where the model is cut — but not the clients' private LoRA,
their data, or their keep sets. `AttackerKnowledge` holds exactly that, and the
helpers here compute with it what the victim's front would have sent for images
the attacker owns (its auxiliary data).

Causal attention is what makes the visual rows easy to simulate: in LLaVA's prompt
the image comes right after a fixed prefix ("USER:"), so the rows of the visual
tokens at a cut depend only on that prefix and on the kept visual tokens, never on
the question that follows.
"""

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from vlm.loading import ImagePreprocessor
from vlm.segments import (
    llava_parts,
    project_visual_features,
    run_decoder_layers,
    vision_features,
)
from vqa import IMAGE_PLACEHOLDER, VQASample, build_prompt


@dataclass(frozen=True)
class TrainingRecipe:
    """How the victims fine-tune (the server sets the run config, so it knows): what shadow models copy."""

    lr: float
    batch_size: int
    # Optimiser steps each client takes over the run.
    steps: int


@dataclass
class AttackerKnowledge:
    """The public model and protocol.

    `model` is the public checkpoint (plain or peft-wrapped with untrained adapters:
    LoRA's zero B makes them the identity); attacks copy it before training anything.
    `cuts` are the decoder cuts of the run (SL: (C,), USL: (CA, CB), FL: ()).
    `instruction` is the prompt's instruction line (None: LLaVA's default).
    `recipe` is the victims' fine-tuning recipe when known.
    """

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    preprocess_images: ImagePreprocessor
    cuts: tuple[int, ...]
    instruction: str | None = ""
    recipe: TrainingRecipe | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    # -- shapes ----------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return llava_parts(self.model).config

    @property
    def hidden_size(self) -> int:
        return self.config.text_config.hidden_size

    @property
    def num_layers(self) -> int:
        return llava_parts(self.model).num_layers

    @property
    def image_size(self) -> int:
        return self.config.vision_config.image_size

    @property
    def patch_size(self) -> int:
        return self.config.vision_config.patch_size

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @property
    def first_cut(self) -> int:
        if not self.cuts:
            raise ValueError("this run has no cut (CL/FL): no activation crosses to the server")
        return self.cuts[0]

    # -- text ------------------------------------------------------------------------------
    def prompt_ids(self, question: str) -> torch.Tensor:
        ids = self.tokenizer(build_prompt(question, instruction=self.instruction), add_special_tokens=False)
        return torch.tensor(ids["input_ids"], dtype=torch.long)

    def answer_ids(self, answer: str) -> torch.Tensor:
        """Answer tokens and end-of-sequence, as clients train them (training.batches)."""
        ids = self.tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
        return torch.tensor([*ids, self.tokenizer.eos_token_id], dtype=torch.long)

    @property
    def prefix_ids(self) -> torch.Tensor:
        """The template's tokens before the image ("USER:"): fixed for every sample."""
        ids = self.prompt_ids("x")
        image_id = self.config.image_token_id
        where = (ids == image_id).nonzero().flatten()
        if where.numel() != 1:
            raise ValueError(f"the prompt template holds {IMAGE_PLACEHOLDER!r} {where.numel()} times, expected once")
        return ids[: int(where[0])]

    # -- images ----------------------------------------------------------------------------
    def pixel_values(self, samples: Sequence[VQASample]) -> torch.Tensor:
        return self.preprocess_images([sample.image for sample in samples])

    def unit_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """CLIP-normalised pixel values back to [0, 1]: the images as the model saw them."""
        processor = getattr(self.preprocess_images, "image_processor", None)
        if processor is None:
            raise TypeError("unit_images needs an HF image processor (with image_mean/std) to undo its normalisation")
        mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
        return (pixel_values.float() * std + mean).clamp(0, 1)

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """Frozen vision features [B, N, Dv] (the tower is public and never trained)."""
        chunks = [
            vision_features(self.model, pixel_values[i : i + batch_size].to(self.device)).cpu()
            for i in range(0, pixel_values.shape[0], batch_size)
        ]
        return torch.cat(chunks)

    def trainable_front(self) -> nn.Module:
        """A private copy of the model whose adapters in front of the first cut can be trained.

        FORA's substitute client and FSHA's pilot start as the public front; nothing
        else in the copy trains.
        """
        front = copy.deepcopy(self.model)
        for name, parameter in front.named_parameters():
            parameter.requires_grad_(False)
            if "lora_" in name and _layer_of(name) < self.first_cut:
                parameter.requires_grad_(True)
        if not any(p.requires_grad for p in front.parameters()):
            raise ValueError("the public model has no LoRA adapters in front of the first cut to train")
        return front


def _layer_of(name: str) -> int:
    marker = "language_model.layers."
    if marker not in name:
        return -1
    return int(name.split(marker)[1].split(".")[0])


def visual_rows(
    model: nn.Module,
    features: torch.Tensor,
    prefix_ids: torch.Tensor,
    cut: int,
    keep: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The rows a front sends at `cut` for the visual tokens of each image: [k_b, D] each.

    `keep[b]` are the patch indices sample b sends, in the order it sends them (the
    client's keep set, possibly shuffled); None keeps every patch in order. Samples
    with the same k run as one batch. Differentiable in the model's parameters.
    """
    batch = features.shape[0]
    keep = [torch.arange(features.shape[1])] * batch if keep is None else list(keep)
    if len(keep) != batch:
        raise ValueError(f"got {len(keep)} keep sets for {batch} images")
    parts = llava_parts(model)
    device = parts.lm_head.weight.device
    dtype = parts.lm_head.weight.dtype
    prefix = parts.language_model.embed_tokens(prefix_ids.to(device))
    out: list[torch.Tensor | None] = [None] * batch
    by_size: dict[int, list[int]] = {}
    for index, indices in enumerate(keep):
        by_size.setdefault(int(indices.numel()), []).append(index)
    for members in by_size.values():
        chosen = torch.stack([features[i, keep[i]] for i in members]).to(device, dtype)
        visual = project_visual_features(model, chosen)
        hidden = torch.cat([prefix.unsqueeze(0).expand(len(members), -1, -1), visual], dim=1)
        length = hidden.shape[1]
        mask = torch.ones(len(members), length, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device).unsqueeze(0).expand(len(members), -1)
        rows = run_decoder_layers(model, hidden, mask, positions, 0, cut)[:, prefix_ids.numel() :]
        for slot, index in enumerate(members):
            out[index] = rows[slot]
    return out  # type: ignore[return-value]


def split_packed(rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Packed rows [n, D] -> each sample's rows [L_b, D] (the wire's packing, wire.pack_rows)."""
    return list(torch.split(rows, [int(n) for n in lengths.tolist()]))
