"""Model profiles: one LLaVA-1.5 code path at three sizes.

A profile holds every architectural number and default cut in one place, so the
paper-scale model, the offline mini model and the test model differ only in data.
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

from registry import Registry
from vlm.cuts import default_sl_cut, default_usl_cuts, validate_sl_cut, validate_usl_cuts

VISION_FEATURE_SELECT_STRATEGIES = ("default", "full")

# The paper keeps at least 16 of LLaVA's 576 patches; other sizes keep the same share.
K_MIN_SHARE_OF_PATCHES = 16 / 576


@dataclass(frozen=True)
class Profile:
    """Architecture and split defaults of one model size.

    `vision` and `text` are keyword arguments for CLIPVisionConfig and LlamaConfig
    (image and patch size live in their own fields because N derives from them).
    `sl_cut`, `usl_cuts` and `k_min` default to the paper's proportions
    (C = L/2, CA = L/4, CB = 3L/4, k_min ≈ 2.8% of N) when left as None.
    A profile whose vocabulary comes from a data-built tokenizer leaves `vocab_size`,
    `pad_token_id` (in `text`) and `image_token_id` unset; build_llava_config then
    requires them as overrides.
    """

    name: str
    vision: Mapping[str, Any]
    text: Mapping[str, Any]
    image_size: int
    patch_size: int
    image_token_id: int | None
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    sl_cut: int | None = None
    usl_cuts: tuple[int, int] | None = None
    k_min: int | None = None
    lora_rank: int = 32
    hf_id: str | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Private copies (not read-only proxies, which cannot be pickled to Ray workers).
        object.__setattr__(self, "vision", dict(self.vision))
        object.__setattr__(self, "text", dict(self.text))
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"profile {self.name!r}: image_size={self.image_size} is not a multiple of "
                f"patch_size={self.patch_size}"
            )
        if self.vision_feature_select_strategy not in VISION_FEATURE_SELECT_STRATEGIES:
            raise ValueError(
                f"profile {self.name!r}: vision_feature_select_strategy="
                f"{self.vision_feature_select_strategy!r}; allowed: {VISION_FEATURE_SELECT_STRATEGIES}"
            )
        vision_hidden_states = self.vision["num_hidden_layers"] + 1
        if not -vision_hidden_states <= self.vision_feature_layer < vision_hidden_states:
            raise ValueError(
                f"profile {self.name!r}: vision_feature_layer={self.vision_feature_layer} is out of range "
                f"[{-vision_hidden_states}, {vision_hidden_states - 1}] for a "
                f"{self.vision['num_hidden_layers']}-layer vision tower"
            )
        num_layers = self.num_layers
        sl_cut = default_sl_cut(num_layers) if self.sl_cut is None else self.sl_cut
        usl_cuts = default_usl_cuts(num_layers) if self.usl_cuts is None else tuple(self.usl_cuts)
        validate_sl_cut(sl_cut, num_layers)
        validate_usl_cuts(usl_cuts, num_layers)
        object.__setattr__(self, "sl_cut", sl_cut)
        object.__setattr__(self, "usl_cuts", usl_cuts)
        k_min = math.ceil(K_MIN_SHARE_OF_PATCHES * self.num_patches) if self.k_min is None else self.k_min
        if not 1 <= k_min <= self.num_patches:
            raise ValueError(
                f"profile {self.name!r}: k_min={k_min} is out of range [1, {self.num_patches}] (N patches)"
            )
        object.__setattr__(self, "k_min", k_min)
        if self.lora_rank < 1:
            raise ValueError(f"profile {self.name!r}: lora_rank={self.lora_rank} must be >= 1")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_layers(self) -> int:
        return self.text["num_hidden_layers"]

    @property
    def vision_blocks(self) -> int:
        """The vision tower's layers that run: those up to the vision feature layer."""
        return self.vision_feature_layer % (self.vision["num_hidden_layers"] + 1)

    @property
    def vision_hidden_size(self) -> int:
        return self.vision["hidden_size"]

    @property
    def hidden_size(self) -> int:
        return self.text["hidden_size"]


PROFILES: Registry[Profile] = Registry("model profile")
register_profile, get_profile = PROFILES.register, PROFILES.get


def profile_names() -> list[str]:
    return sorted(PROFILES.names())


def build_llava_config(
    profile: Profile,
    *,
    vocab_size: int | None = None,
    image_token_id: int | None = None,
    pad_token_id: int | None = None,
    attn_implementation: str = "sdpa",
) -> LlavaConfig:
    """LlavaConfig for a profile; the overrides supply a data-built tokenizer's vocabulary."""
    text_kwargs = dict(profile.text)
    if vocab_size is not None:
        text_kwargs["vocab_size"] = vocab_size
    if pad_token_id is not None:
        text_kwargs["pad_token_id"] = pad_token_id
    image_token_id = profile.image_token_id if image_token_id is None else image_token_id
    missing = [
        name
        for name, value in (
            ("vocab_size", text_kwargs.get("vocab_size")),
            ("image_token_id", image_token_id),
            ("pad_token_id", text_kwargs.get("pad_token_id")),
        )
        if value is None
    ]
    if missing:
        raise ValueError(
            f"profile {profile.name!r} takes its vocabulary from a tokenizer; pass {', '.join(missing)} "
            "to build_llava_config"
        )
    for name, token_id in (("image_token_id", image_token_id), ("pad_token_id", text_kwargs["pad_token_id"])):
        if not 0 <= token_id < text_kwargs["vocab_size"]:
            raise ValueError(f"{name}={token_id} is outside the vocabulary [0, {text_kwargs['vocab_size']})")
    vision_config = CLIPVisionConfig(
        **profile.vision, image_size=profile.image_size, patch_size=profile.patch_size
    )
    text_config = LlamaConfig(**text_kwargs)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        vision_feature_layer=profile.vision_feature_layer,
        vision_feature_select_strategy=profile.vision_feature_select_strategy,
        projector_hidden_act=profile.projector_hidden_act,
        image_seq_length=profile.num_patches,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    config._attn_implementation = attn_implementation
    config.vision_config._attn_implementation = attn_implementation
    config.text_config._attn_implementation = attn_implementation
    return config


LLAVA_15_7B = register_profile(
    Profile(
        name="llava-1.5-7b",
        description="The paper's model: CLIP ViT-L/14-336 + 2-layer GELU projector + Llama-2-7B (Vicuna) decoder",
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            projection_dim=768,
            hidden_act="quick_gelu",
            layer_norm_eps=1e-5,
        ),
        text=dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            pad_token_id=32001,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
        image_size=336,
        patch_size=14,
        image_token_id=32000,
        sl_cut=16,
        usl_cuts=(8, 24),
        k_min=16,
        hf_id="llava-hf/llava-1.5-7b-hf",
    )
)

MINI = register_profile(
    Profile(
        name="mini",
        description="Offline default sized for a laptop CPU; vocabulary from the data-built tokenizer",
        vision=dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
            hidden_act="quick_gelu",
        ),
        text=dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=512,
            # Tied: the colour a decoder would say and the colour word it reads share one
            # vector, which lets yes/no comparison emerge within a CPU budget (stages.py).
            tie_word_embeddings=True,
        ),
        image_size=64,
        patch_size=8,
        image_token_id=None,
        sl_cut=4,
        usl_cuts=(2, 6),
        k_min=2,
    )
)

# The same architecture, built with a patch-position loss in its vision stage
# (vlm/mini/recipe.py: vision_position_loss_weight): its visual rows keep where their patch
# was, as CLIP's do, which the default mini's lose by the feature layer. Position-recovery
# attacks (SARA) and the defenses against them are measured on it.
MINI_POSITIONAL = register_profile(
    dataclasses.replace(MINI, name="mini-positional",
            description="The mini model whose visual rows keep their patch position (SARA, the positionless edge)")
)

# The same architecture, whose base stage also learned from multi-image conversations
# (vlm/mini/recipe.py: base_interleaved_share), as interleaved-data VLMs do: the mini's base
# answers no better with in-context demonstrations than without, and task vectors (seed 003)
# distil what demonstrations teach, so they are measured on this one.
MINI_INTERLEAVED = register_profile(
    dataclasses.replace(MINI, name="mini-interleaved",
            description="The mini model that learned in-context demonstrations in its base stage (task vectors, DP-MTV)")
)

# The scene testbed's model (vqa.scenes): the mini's sizes with a vision tower whose patch rows
# stay local (each row attends only to itself: vlm.segments.local_attention_mask), so a pruned
# patch takes its content with it, as it cannot in the mini, whose every row holds the whole image.
MINI_SCENES = register_profile(
    dataclasses.replace(
        MINI,
        name="mini-scenes",
        vision={**MINI.vision, "patch_attention_radius": 0},
        description="The mini model trained on generated scenes, its visual rows local to their patch (the testbed)",
    )
)

TINY = register_profile(
    Profile(
        name="tiny",
        description="Random weights for tests; grouped-query attention (2 heads, 1 KV head) to exercise that path",
        vision=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_act="quick_gelu",
        ),
        text=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            pad_token_id=63,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        image_size=32,
        patch_size=8,
        image_token_id=62,
        sl_cut=2,
        usl_cuts=(1, 3),
        k_min=1,
        lora_rank=4,
    )
)
