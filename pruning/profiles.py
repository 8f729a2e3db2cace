"""QPriv-VL's sizes per model profile: the two frozen encoders and the trained heads.

A pruning profile is registered under the name of the model profile it prunes for
(vlm.profiles), whose vision tower fixes what QPriv-VL reads: N patches on a square
CLIP grid of width Dv, and the k_min floor. The paper-size numbers (SPEC §1) come out
of `llava-1.5-7b`; `mini` and `tiny` carry small random-but-seeded encoders of the same
classes, with a DINO grid coarser than the CLIP grid so the bilinear upsample is real.
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from registry import Registry
from vlm.profiles import PROFILES, Profile

# The sensitivity summary fed to the threshold head: mean, max, fraction above 0.5.
SENSITIVITY_SUMMARY_SIZE = 3


@dataclass(frozen=True)
class TowerRecipe:
    """How a small profile's question and sensitivity towers are trained (pruning.towers).

    The text tower (CLIP-T's stand-in) learns, jointly with a relevance read-out of QPriv-VL's
    shapes (Wq0: Dt -> P, Wk0: Dv -> P), to score the frozen CLIP-V patch rows of the model's
    vision tower against the patches each question needs (`dataset`'s `needed_boxes`), with
    binary cross-entropy: the question-patch alignment CLIP's contrastive training gives the
    paper's scorer (plus `text_listwise` times a listwise ranking term). The DINO stand-in learns self-supervised per-patch content: each patch's
    pixels reconstructed from its own output row (denoised from inputs with `dino_noise` std
    Gaussian noise). No privacy label enters either; privacy is learned only by H_sens from
    bag labels, as in the paper. Every number here enters the build's cache key.
    """

    dataset: str = "scenes-stamped"
    split: str = "train"
    # Training samples of `dataset` (0: the whole split), a seeded subset as load_vqa draws it.
    samples: int = 0
    seed: int = 0
    text_epochs: int = 60
    text_lr: float = 5e-3
    text_batch_size: int = 256
    # Weight of a listwise term beside the BCE: cross-entropy of the softmax over an image's
    # patches, averaged over the needed ones (the ranking the top-k keep reads).
    text_listwise: float = 0.5
    dino_epochs: int = 30
    dino_lr: float = 2e-3
    dino_batch_size: int = 64
    dino_noise: float = 0.1
    # Torch threads while training: the same count gives the same towers.
    threads: int = 1


@dataclass(frozen=True)
class PruningProfile:
    """Sizes of QPriv-VL for one model profile.

    `text` and `dino` are keyword arguments for CLIPTextConfig and Dinov2Config; the
    text vocabulary is not among them because a random tower reads the decoder's
    tokenizer (its size is only known once that exists). `dino_image_size` is what
    images are resized to for DINOv2, so its grid is dino_image_size // patch_size.
    `text_hf_id`/`dino_hf_id` name real checkpoints; a profile without them builds its
    seeded random encoders (from `encoder_seed`), unless it names `towers`: then its two
    towers are trained once against its model's vision tower (pruning.towers) and loaded
    from that build.
    """

    name: str
    text: Mapping[str, Any]
    dino: Mapping[str, Any]
    dino_image_size: int
    projection_dim: int
    sensitivity_hidden: tuple[int, ...]
    threshold_hidden: tuple[int, ...]
    text_hf_id: str | None = None
    dino_hf_id: str | None = None
    encoder_seed: int = 0
    towers: TowerRecipe | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", dict(self.text))
        object.__setattr__(self, "dino", dict(self.dino))
        model = self.model
        clip_grid = math.isqrt(model.num_patches)
        if clip_grid**2 != model.num_patches:
            raise ValueError(f"pruning profile {self.name!r}: N={model.num_patches} CLIP patches are not a square grid")
        if self.dino_image_size % self.dino["patch_size"] != 0:
            raise ValueError(
                f"pruning profile {self.name!r}: dino_image_size={self.dino_image_size} is not a multiple of "
                f"the DINO patch_size={self.dino['patch_size']}"
            )
        if self.dino_grid > clip_grid:
            raise ValueError(
                f"pruning profile {self.name!r}: the DINO grid ({self.dino_grid}) must not be finer than the "
                f"CLIP grid ({clip_grid}); the sensitivity map is upsampled to the CLIP grid"
            )

    @property
    def model(self) -> Profile:
        """The model profile this prunes for (same name)."""
        return PROFILES.get(self.name)

    @property
    def num_patches(self) -> int:
        return self.model.num_patches

    @property
    def clip_grid(self) -> int:
        return math.isqrt(self.model.num_patches)

    @property
    def dino_grid(self) -> int:
        return self.dino_image_size // self.dino["patch_size"]

    @property
    def vision_hidden_size(self) -> int:
        return self.model.vision_hidden_size

    @property
    def text_hidden_size(self) -> int:
        return self.text["hidden_size"]

    @property
    def dino_hidden_size(self) -> int:
        return self.dino["hidden_size"]

    @property
    def k_min(self) -> int:
        return self.model.k_min

    @property
    def threshold_input_size(self) -> int:
        """[pooled image; question; sensitivity summary]: 1024 + 768 + 3 = 1795 at 7B."""
        return self.vision_hidden_size + self.text_hidden_size + SENSITIVITY_SUMMARY_SIZE


# Keyed by the model profiles' registry: a pruning profile whose name vlm.profiles does not
# register cannot be built (PruningProfile.model).
PRUNING_PROFILES: Registry[PruningProfile] = Registry("pruning profile")
register_pruning_profile, get_pruning_profile = PRUNING_PROFILES.register, PRUNING_PROFILES.get


def pruning_profile_names() -> list[str]:
    return sorted(PRUNING_PROFILES.names())


LLAVA_15_7B = register_pruning_profile(
    PruningProfile(
        name="llava-1.5-7b",
        description="SPEC §1: CLIP ViT-L/14-336 text tower (768), DINOv2 ViT-S/14 at 224 (16×16, 384), P=256",
        text=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            projection_dim=768,
            hidden_act="quick_gelu",
        ),
        dino=dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4, image_size=518, patch_size=14),
        dino_image_size=224,
        projection_dim=256,
        sensitivity_hidden=(128, 128),
        threshold_hidden=(512, 512),
        text_hf_id="openai/clip-vit-large-patch14-336",
        dino_hf_id="facebook/dinov2-small",
    )
)

MINI = register_pruning_profile(
    PruningProfile(
        name="mini",
        description="Seeded random encoders for the 64×64 mini model: DINO 4×4 grid upsampled to CLIP's 8×8",
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            projection_dim=64,
            hidden_act="quick_gelu",
        ),
        dino=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=64, patch_size=16),
        dino_image_size=64,
        projection_dim=32,
        sensitivity_hidden=(32, 32),
        threshold_hidden=(64, 64),
    )
)

# The mini variants (a vision stage that keeps patch positions, a base that learned in-context
# demonstrations) have the mini's encoders.
MINI_POSITIONAL = register_pruning_profile(dataclasses.replace(MINI, name="mini-positional"))
MINI_INTERLEAVED = register_pruning_profile(dataclasses.replace(MINI, name="mini-interleaved"))
# The scene testbed's towers are trained (pruning.towers): random towers rank nothing, and the
# testbed measures question-guided, privacy-aware ranking.
MINI_SCENES = register_pruning_profile(
    dataclasses.replace(
        MINI,
        name="mini-scenes",
        towers=TowerRecipe(),
        description="The mini's sizes with trained towers: a question tower aligned to the local CLIP-V rows "
        "of the mini-scenes model, and a DINO stand-in pretrained on per-patch content",
    )
)

TINY = register_pruning_profile(
    PruningProfile(
        name="tiny",
        description="Seeded random encoders for tests: DINO 2×2 grid upsampled to CLIP's 4×4",
        text=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            projection_dim=16,
            hidden_act="quick_gelu",
        ),
        dino=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=32, patch_size=16),
        dino_image_size=32,
        projection_dim=8,
        sensitivity_hidden=(8, 8),
        threshold_hidden=(16, 16),
    )
)
