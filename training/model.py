"""The model every party builds from the run config: same base weights, same LoRA start.

Each party builds the whole model but trains and keeps only its own segment's
adapters (vlm.cuts / vlm.lora); the frozen base is identical everywhere because it
comes from the same checkpoint (or, for `tiny`, the same seed).
"""

from dataclasses import dataclass

import torch
from peft import PeftModel

from config import SimConfig
from vlm.cuts import LayerSegment, split_layers
from vlm.loading import ModelBundle, ModelNotAvailableError, build_random_model, clip_image_preprocessor, load_model
from vlm.lora import apply_lora
from vlm.profiles import TINY, get_profile
from vlm.mini.tokenizer import PAD, SPECIAL_TOKENS
from vqa import IMAGE_PLACEHOLDER, SHORT_ANSWER_INSTRUCTION

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Random-weight models take the word tokenizer's fixed special-token ids and a fixed
# vocabulary size, so a party that never reads text (the USL server) builds the same
# model without a tokenizer; 64 holds easy-VQA's words.
RANDOM_PAD_ID = SPECIAL_TOKENS.index(PAD)
RANDOM_IMAGE_ID = SPECIAL_TOKENS.index(IMAGE_PLACEHOLDER)
RANDOM_VOCAB_SIZE = 64


@dataclass
class PartyModel:
    """A party's model: LoRA-wrapped, with the run's segments and prompt instruction."""

    bundle: ModelBundle
    model: PeftModel
    segments: tuple[LayerSegment, ...]
    device: torch.device

    @property
    def instruction(self) -> str | None:
        # The offline profiles are trained without LLaVA's short-answer line (vlm.mini.recipe).
        return SHORT_ANSWER_INSTRUCTION if self.bundle.profile.hf_id else ""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_bundle(config: SimConfig, device: torch.device) -> ModelBundle:
    profile = get_profile(config.model.profile)
    dtype = COMPUTE_DTYPES[config.model.dtype]
    if profile.name == TINY.name or config.model.stage == "random":
        model = build_random_model(
            profile,
            seed=config.model.seed,
            dtype=dtype,
            vocab_size=RANDOM_VOCAB_SIZE,
            image_token_id=RANDOM_IMAGE_ID,
            pad_token_id=RANDOM_PAD_ID,
        )
        return ModelBundle(model, profile, None, clip_image_preprocessor(profile.image_size))
    if profile.hf_id:
        try:
            return load_model(profile, source=config.model.source or None, dtype=dtype, device=str(device))
        except ModelNotAvailableError as error:
            raise ModelNotAvailableError(
                f"{error} With flwr run: --run-config 'model.source=\"/path/to/llava-1.5-7b-hf\"'."
            ) from error
    return load_model(profile, stage=config.model.stage)


def load_party_model(config: SimConfig) -> PartyModel:
    """The run's model with LoRA on every decoder layer, initialised from `model.seed`."""
    device = resolve_device(config.model.device)
    bundle = load_bundle(config, device)
    base = bundle.model.to(device)
    # Every party (and the one-process reference) must start from the same adapters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.model.seed)
        model = apply_lora(base, rank=config.model.lora_rank)
    model.to(device)
    segments = split_layers(get_profile(config.model.profile).num_layers, config.cuts)
    return PartyModel(bundle=bundle, model=model, segments=segments, device=device)


def make_optimizer(parameters, config: SimConfig) -> torch.optim.AdamW:
    """The one optimiser recipe of every paradigm; AdamW is per-parameter, so one
    optimiser over all adapters equals one per owner over their own."""
    return torch.optim.AdamW(list(parameters), lr=config.train.lr, weight_decay=config.train.weight_decay)
