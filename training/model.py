"""The model every party builds from the run config: same base weights, same LoRA start.

A party trains and keeps only its own segments' adapters (vlm.cuts / vlm.lora); the
frozen base is identical everywhere because it comes from the same checkpoint (or,
for `tiny`, the same seed). A party given its role materialises only the modules its
segments run and leaves the rest on the meta device; without a role (an attacking
server, attack replays, the one-process reference) it holds the whole public model.
"""

from dataclasses import dataclass

import torch
from peft import PeftModel
from torch import nn

from config import SimConfig
from vlm.cuts import LayerSegment, split_layers
from vlm.loading import COMPUTE_DTYPES, ModelBundle, ModelNotAvailableError, ParameterCounts, load_weights
from vlm.lora import apply_lora
from vlm.paradigms import FL, SL, USL, Paradigm
from vlm.profiles import Profile, get_profile
from vlm.segments import llava_parts
from vlm.mini.tokenizer import PAD, SPECIAL_TOKENS
from vqa import IMAGE_PLACEHOLDER, SHORT_ANSWER_INSTRUCTION

# Random-weight models take the word tokenizer's fixed special-token ids and a fixed
# vocabulary size, so a party that never reads text (the USL server) builds the same
# model without a tokenizer; 64 holds easy-VQA's words.
RANDOM_PAD_ID = SPECIAL_TOKENS.index(PAD)
RANDOM_IMAGE_ID = SPECIAL_TOKENS.index(IMAGE_PLACEHOLDER)
RANDOM_VOCAB_SIZE = 64
CLIENT, SERVER = "client", "server"


@dataclass
class PartyModel:
    """A party's model: LoRA-wrapped, with the run's segments and prompt instruction."""

    bundle: ModelBundle
    model: PeftModel
    segments: tuple[LayerSegment, ...]
    device: torch.device

    @property
    def instruction(self) -> str | None:
        return prompt_instruction(self.bundle.profile)


def prompt_instruction(profile: Profile) -> str | None:
    """The line a prompt ends its question with: LLaVA-1.5's short-answer instruction for the
    paper's model; none for the offline profiles, trained without it (vlm.mini.recipe)."""
    return SHORT_ANSWER_INSTRUCTION if profile.hf_id else ""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_bundle(config: SimConfig, device: torch.device) -> ModelBundle:
    try:
        return load_weights(
            config.model.profile,
            stage=config.model.stage,
            source=config.model.source or None,
            dtype=COMPUTE_DTYPES[config.model.dtype],
            device=device,
            seed=config.model.seed,
            random_token_ids=dict(
                vocab_size=RANDOM_VOCAB_SIZE, image_token_id=RANDOM_IMAGE_ID, pad_token_id=RANDOM_PAD_ID
            ),
        )
    except ModelNotAvailableError as error:
        if not get_profile(config.model.profile).hf_id:
            raise
        raise ModelNotAvailableError(
            f"{error} With flwr run: --run-config 'model.source=\"/path/to/llava-1.5-7b-hf\"'."
        ) from error


def load_party_model(config: SimConfig, role: str | None = None) -> PartyModel:
    """The run's model with LoRA on every decoder layer, initialised from `model.seed`.

    `role` (CLIENT or SERVER): keep only the modules that party's segments run, the rest
    on the meta device; None: the whole model.
    """
    device = resolve_device(config.model.device)
    bundle = load_bundle(config, device)
    base = bundle.model.to(device)
    # Every party (and the one-process reference) must start from the same adapters; LoRA
    # goes on before anything moves to meta, whose initialisers draw no random numbers.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.model.seed)
        model = apply_lora(base, rank=config.model.lora_rank)
    model.to(device)
    segments = split_layers(get_profile(config.model.profile).num_layers, config.cuts)
    if role is not None:
        run = party_segments(segments, config.paradigm_spec, role)
        for module, runs in party_modules(model, run):
            if not runs:
                module.to("meta")
    if device.type == "cuda":
        # Processes sharing one GPU (the server and Ray's fractional-GPU clients) get back what the
        # modules a party discards and random weights' float32 draw held; the caching allocator
        # would otherwise keep it for this process.
        torch.cuda.empty_cache()
    return PartyModel(bundle=bundle, model=model, segments=segments, device=device)


def party_owners(paradigm: Paradigm, role: str) -> tuple[str, ...]:
    """The segments (vlm.cuts owners) the party in `role` runs, trains and keeps."""
    return paradigm.client_owners if role == CLIENT else paradigm.server_owners


def party_segments(segments: tuple[LayerSegment, ...], paradigm: Paradigm, role: str) -> tuple[LayerSegment, ...]:
    owners = party_owners(paradigm, role)
    return tuple(segment for segment in segments if segment.owner in owners)


def party_modules(model: nn.Module, run: tuple[LayerSegment, ...]) -> list[tuple[nn.Module, bool]]:
    """Every base module of the model, and whether a party running segments `run` needs it:
    the first segment also runs vision tower, projector and embeddings, the last the final
    norm and the LM head (the same rule as vlm.loading.ParameterCounts.for_segment)."""
    parts = llava_parts(model)
    front = any(segment.start == 0 for segment in run)
    back = any(segment.is_last for segment in run)
    decoder = parts.language_model
    modules = [(parts.vision_tower, front), (parts.projector, front), (decoder.embed_tokens, front)]
    modules += [(layer, any(index in segment for segment in run)) for index, layer in enumerate(decoder.layers)]
    return [*modules, (decoder.norm, back), (parts.lm_head, back)]


def party_parameter_bytes(profile: Profile, counts: ParameterCounts) -> dict[str, dict[str, int]]:
    """The frozen base bytes each party holds at the profile's default cuts, LoRA excluded,
    in 16-bit (fp16/bf16) and fp32; `counts` from vlm.loading.count_parameters (a
    meta-device model counts at any size)."""
    held = {}
    for paradigm, role in ((USL, CLIENT), (USL, SERVER), (SL, CLIENT), (SL, SERVER), (FL, CLIENT)):
        segments = split_layers(profile.num_layers, paradigm.cut_layers(profile.sl_cut, profile.usl_cuts))
        parameters = sum(counts.for_segment(segment) for segment in party_segments(segments, paradigm, role))
        held[f"{paradigm.name} {role}"] = {"16-bit": 2 * parameters, "fp32": 4 * parameters}
    return held


def make_optimizer(parameters, config: SimConfig) -> torch.optim.AdamW:
    """The one optimiser recipe of every paradigm; AdamW is per-parameter, so one
    optimiser over all adapters equals one per owner over their own."""
    return torch.optim.AdamW(list(parameters), lr=config.train.lr, weight_decay=config.train.weight_decay)
