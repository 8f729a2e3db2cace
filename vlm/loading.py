"""Getting a model for a profile: real weights, random weights, or shapes only.

`load_weights` is the one decision of which weights a run's model has (random, real
or a built checkpoint); every party of a run (training.model) and the DTP preparation
(pruning.prepare) load through it. Loaders live in a registry keyed by profile name so
that a profile with its own way of loading (the mini model's trained checkpoint) plugs
in without an if/elif chain here. Profiles whose loader lives in a separate module are
imported on first use (LAZY_LOADER_MODULES), so callers need not remember to import them.
"""

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from huggingface_hub import try_to_load_from_cache
from PIL import Image
from torch import nn
from transformers import (
    AutoProcessor,
    CLIPImageProcessorPil,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerBase,
)

from vlm.cuts import LayerSegment
from vlm.profiles import TINY, Profile, build_llava_config, get_profile
from vlm.segments import llava_parts

# Files whose presence shows a complete HF checkpoint folder (config plus sharded or single weights).
CONFIG_FILE = "config.json"
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "model.safetensors")
# The stage of seeded random weights at a profile's shapes (costs, tests), whatever the profile.
RANDOM_STAGE = "random"
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelNotAvailableError(RuntimeError):
    """Real weights are neither in a local folder nor in the local HF cache."""


class ImagePreprocessor(Protocol):
    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor: ...


class HFImagePreprocessor:
    """PIL images -> normalised pixel_values [B, 3, H, W] through an HF image processor.

    A class rather than a closure so that bundles can be pickled (e.g. to Ray workers).
    """

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor

    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        return self.image_processor(list(images), return_tensors="pt")["pixel_values"]


def clip_image_preprocessor(image_size: int) -> HFImagePreprocessor:
    """CLIP's resize, centre crop and normalisation at a profile's image size."""
    return HFImagePreprocessor(
        CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
    )


@dataclass
class ModelBundle:
    """What the rest of the system passes around: the model and how to feed it."""

    model: nn.Module
    profile: Profile
    tokenizer: PreTrainedTokenizerBase | None
    preprocess_images: ImagePreprocessor


ModelLoader = Callable[..., ModelBundle]

_LOADERS: dict[str, ModelLoader] = {}
LAZY_LOADER_MODULES = {
    "mini": "vlm.mini", "mini-positional": "vlm.mini", "mini-interleaved": "vlm.mini", "mini-scenes": "vlm.mini",
}


def register_loader(profile_name: str, loader: ModelLoader, *, replace: bool = False) -> None:
    """Register `loader(profile, **options) -> ModelBundle` for a profile name."""
    if profile_name in _LOADERS and not replace:
        raise ValueError(f"a loader for profile {profile_name!r} is already registered; pass replace=True")
    _LOADERS[profile_name] = loader


def load_model(profile: str | Profile, **options: Any) -> ModelBundle:
    """Load the model for a profile; `options` go to that profile's loader."""
    profile = get_profile(profile) if isinstance(profile, str) else profile
    if profile.name not in _LOADERS and profile.name in LAZY_LOADER_MODULES:
        module = LAZY_LOADER_MODULES[profile.name]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
            raise ValueError(
                f"profile {profile.name!r} is loaded by module {module!r}, which is not installed"
            ) from error
    try:
        loader = _LOADERS[profile.name]
    except KeyError:
        raise ValueError(
            f"no loader registered for profile {profile.name!r}; registered: {sorted(_LOADERS)}"
        ) from None
    return loader(profile, **options)


def build_random_model(
    profile: Profile,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    **config_overrides: Any,
) -> LlavaForConditionalGeneration:
    """Randomly initialised model on `device`; the same seed and device give the same weights,
    without touching global RNG state.

    The weights are drawn on `device` itself: drawing a 7B model on the CPU takes a minute per
    process, on a GPU a fraction of a second (its generator draws other numbers than the CPU's)."""
    config = build_llava_config(profile, attn_implementation=attn_implementation, **config_overrides)
    device = torch.device(device)
    accelerator = [] if device.type in ("cpu", "meta") else [device]
    with torch.random.fork_rng(devices=accelerator, device_type=device.type if accelerator else None), device:
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    return model.to(dtype).eval()


def build_model_on_meta(profile: Profile, **config_overrides: Any) -> LlavaForConditionalGeneration:
    """The model's structure without memory, for counting parameters at any size."""
    config = build_llava_config(profile, **config_overrides)
    with torch.device("meta"):
        return LlavaForConditionalGeneration(config)


def load_random(
    profile: Profile,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> ModelBundle:
    """Loader for random-weight profiles (tests): no tokenizer, callers pass token ids."""
    return ModelBundle(
        model=build_random_model(profile, seed=seed, dtype=dtype, attn_implementation=attn_implementation),
        profile=profile,
        tokenizer=None,
        preprocess_images=clip_image_preprocessor(profile.image_size),
    )


def unavailable(owner: str, hub_id: str | None, what: str, source_key: str = "model.source") -> ModelNotAvailableError:
    """The error for missing real weights: what is missing and how to supply it offline."""
    repo = hub_id or "<hub id>"
    return ModelNotAvailableError(
        f"weights for {owner} are not available: {what}. On a machine with hub access run "
        f"`hf download {repo} --local-dir DIR`, copy DIR here, and point the source (`source=` / the run "
        f"config's {source_key}) at DIR."
    )


def _looks_like_hub_id(source: str) -> bool:
    return source.count("/") == 1 and not source.startswith((".", "/", "~"))


def resolve_checkpoint(
    owner: str,
    hub_id: str | None,
    source: str | Path | None,
    cache_dir: str | Path | None,
    source_key: str = "model.source",
) -> Path:
    """A local checkpoint folder for `source` (a folder, or a hub id already in the HF cache).

    `owner` names what the weights are for and `source_key` the run-config key that
    points at them, in errors; `hub_id` is used when `source` is None. Never contacts
    the hub: a missing model must fail in milliseconds, not after from_pretrained's
    minutes of retries.
    """
    source = hub_id if source is None else source
    if source is None:
        raise unavailable(owner, hub_id, "no hub id is known and no source was given", source_key)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise unavailable(owner, hub_id, f"folder {path} has no {CONFIG_FILE}", source_key)
        return path
    if path.exists() or not _looks_like_hub_id(str(source)):
        raise unavailable(owner, hub_id, f"source {str(source)!r} is neither a checkpoint folder nor a hub id", source_key)
    cached_config = try_to_load_from_cache(str(source), CONFIG_FILE, cache_dir=cache_dir)
    if not isinstance(cached_config, str):
        raise unavailable(owner, hub_id, f"{source!r} is not a local folder and is not in the local HF cache", source_key)
    snapshot = Path(cached_config).parent
    if not any((snapshot / name).is_file() for name in WEIGHT_INDEX_FILES):
        raise unavailable(owner, hub_id, f"the HF cache holds {source!r}'s config but not its weights ({snapshot})", source_key)
    return snapshot


def resolve_pretrained_source(profile: Profile, source: str | Path | None, cache_dir: str | Path | None) -> Path:
    """The local LLaVA checkpoint folder of a profile (see resolve_checkpoint)."""
    return resolve_checkpoint(f"profile {profile.name!r}", profile.hf_id, source, cache_dir)


def load_pretrained_llava(
    profile: Profile,
    *,
    source: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    cache_dir: str | Path | None = None,
) -> ModelBundle:
    """Loader for real LLaVA-1.5 weights from a local folder or the local HF cache."""
    checkpoint = resolve_pretrained_source(profile, source, cache_dir)
    try:
        model = LlavaForConditionalGeneration.from_pretrained(
            checkpoint,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device_map=device,
            local_files_only=True,
        )
        processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    except OSError as error:
        raise unavailable(f"profile {profile.name!r}", profile.hf_id, f"loading {checkpoint} failed ({error})") from error
    return ModelBundle(
        model=model.eval(),
        profile=profile,
        tokenizer=processor.tokenizer,
        preprocess_images=HFImagePreprocessor(processor.image_processor),
    )


def uses_random_weights(profile: Profile, stage: str) -> bool:
    """Stage "random", or a profile without weights of its own (tiny)."""
    return stage == RANDOM_STAGE or profile.name == TINY.name


def describe_weights(profile: str, stage: str, source: str | Path | None = None) -> str:
    """Which weights a run or result used, for its record: seeded random weights, the checkpoint
    it was pointed at, or a mini build's recipe fingerprint and weights digest."""
    if uses_random_weights(get_profile(profile), stage):
        return f"{profile} random weights (seeded)"
    if profile in LAZY_LOADER_MODULES:
        # Through the registry's module name, as load_model finds the mini loaders (vlm.mini imports this module).
        weights_identity = importlib.import_module(LAZY_LOADER_MODULES[profile]).weights_identity
        return f"{weights_identity(profile)}, {stage} stage"
    return f"{profile} checkpoint {source or get_profile(profile).hf_id}"


def load_weights(
    profile: str | Profile,
    *,
    stage: str,
    source: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    random_token_ids: Mapping[str, int] | None = None,
    cache_dir: str | Path | None = None,
) -> ModelBundle:
    """A profile's model at `stage`, in `dtype` on `device`:

    - seeded random weights (`uses_random_weights`) of the profile's shapes, without a
      tokenizer; `random_token_ids` (vocab_size, image_token_id, pad_token_id) fix its text
      side, so that a party that never reads text builds the same model;
    - a profile with a hub id (llava-1.5-7b): its real checkpoint from `source`, a local
      folder or a hub id already in the local HF cache; absent weights raise
      ModelNotAvailableError in milliseconds, saying how to supply them (`locate_weights`);
    - otherwise the profile's registered loader at `stage` (the mini model's build).
    """
    profile = get_profile(profile) if isinstance(profile, str) else profile
    if uses_random_weights(profile, stage):
        model = build_random_model(profile, seed=seed, dtype=dtype, device=device, **dict(random_token_ids or {}))
        return ModelBundle(model, profile, None, clip_image_preprocessor(profile.image_size))
    if profile.hf_id:
        return load_model(profile, source=source, dtype=dtype, device=str(device), cache_dir=cache_dir)
    bundle = load_model(profile, stage=stage)
    bundle.model.to(device=device, dtype=dtype)
    return bundle


def locate_weights(
    profile: str | Profile, *, stage: str, source: str | Path | None = None, cache_dir: str | Path | None = None
) -> Path | None:
    """The local checkpoint folder `load_weights` would read real weights from (None: random
    weights, or a registered loader's own checkpoint), without loading anything; raises
    ModelNotAvailableError when it is absent, in milliseconds."""
    profile = get_profile(profile) if isinstance(profile, str) else profile
    if uses_random_weights(profile, stage) or not profile.hf_id:
        return None
    return resolve_pretrained_source(profile, source, cache_dir)


@dataclass(frozen=True)
class ParameterCounts:
    """Base-model parameter counts by part, to size what each party holds."""

    vision_tower: int
    projector: int
    embeddings: int
    decoder_layers: tuple[int, ...]
    final_norm: int
    lm_head: int

    @property
    def total(self) -> int:
        return (
            self.vision_tower
            + self.projector
            + self.embeddings
            + sum(self.decoder_layers)
            + self.final_norm
            + self.lm_head
        )

    def for_segment(self, segment: LayerSegment) -> int:
        """Parameters held by a segment's owner: the first also holds everything before
        the decoder (vision, projector, embeddings), the last the final norm and LM head."""
        count = sum(self.decoder_layers[segment.start : segment.stop])
        if segment.start == 0:
            count += self.vision_tower + self.projector + self.embeddings
        if segment.is_last:
            count += self.final_norm + self.lm_head
        return count


def count_parameters(model: nn.Module) -> ParameterCounts:
    """Counts of a plain or peft-wrapped model's base modules, LoRA adapters excluded."""
    parts = llava_parts(model)

    def base_count(module: nn.Module) -> int:
        return sum(p.numel() for name, p in module.named_parameters() if "lora_" not in name)

    return ParameterCounts(
        vision_tower=base_count(parts.vision_tower),
        projector=base_count(parts.projector),
        embeddings=base_count(parts.language_model.embed_tokens),
        decoder_layers=tuple(base_count(layer) for layer in parts.language_model.layers),
        final_norm=base_count(parts.language_model.norm),
        lm_head=base_count(parts.lm_head),
    )


register_loader("llava-1.5-7b", load_pretrained_llava)
register_loader("tiny", load_random)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: memory they really hold, however many
    tensors share one storage (meta tensors hold none)."""
    storages = {}
    for tensor in tensors:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
