"""QPriv-VL's sizes: the paper's numbers at llava-1.5-7b, built from configs only (meta device)."""

import pytest
import torch
from transformers import CLIPTextModel, Dinov2Model

from pruning import QPrivVL, get_pruning_profile
from pruning.encoders import clip_text_config, dino_config
from pruning.profiles import PruningProfile

CLIP_VOCAB_SIZE = 49408  # openai/clip-vit-large-patch14-336


def count(module: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def test_the_7b_profile_holds_the_papers_sizes():
    profile = get_pruning_profile("llava-1.5-7b")
    assert (profile.num_patches, profile.clip_grid, profile.vision_hidden_size) == (576, 24, 1024)
    assert (profile.text_hidden_size, profile.dino_hidden_size, profile.dino_grid) == (768, 384, 16)
    assert (profile.projection_dim, profile.k_min, profile.threshold_input_size) == (256, 16, 1795)
    assert (profile.sensitivity_hidden, profile.threshold_hidden) == ((128, 128), (512, 512))


def test_7b_parameter_counts_match_the_paper_on_the_meta_device():
    with torch.device("meta"):
        module = QPrivVL(get_pruning_profile("llava-1.5-7b"))
    assert next(module.parameters()).device.type == "meta"
    projections = count(module.query_projection) + count(module.key_projection)
    assert projections == 768 * 256 + 1024 * 256 == 458_752  # "≈ 459K", bias-free
    assert count(module.threshold_head) == 1_182_721  # 1795→512→512→1 with biases: "≈ 1.18M"
    assert count(module.sensitivity_head) == 384 * 128 + 128 + 128 * 128 + 128 + 128 + 1 == 65_921
    assert count(module) == 458_752 + 1_182_721 + 65_921 + 1 == 1_707_395  # + γ: "≈ 1.7M"
    assert round(count(module) / 1e6, 1) == 1.7
    assert [layer.weight.shape[1] for layer in module.threshold_head if hasattr(layer, "weight")] == [1795, 512, 512]


def test_7b_encoder_configs_have_the_real_checkpoints_sizes():
    profile = get_pruning_profile("llava-1.5-7b")
    ids = dict(bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    with torch.device("meta"):
        text = CLIPTextModel(clip_text_config(profile, vocab_size=CLIP_VOCAB_SIZE, **ids))
        dino = Dinov2Model(dino_config(profile))
    # The text half of CLIP ViT-L/14-336 and DINOv2 ViT-S/14 (facebook/dinov2-small).
    assert count(text) == 123_060_480
    assert count(dino) == 22_056_576


@pytest.mark.parametrize("name", ["mini", "tiny"])
def test_small_profiles_upsample_a_coarser_dino_grid(name):
    profile = get_pruning_profile(name)
    assert profile.dino_grid < profile.clip_grid
    assert profile.num_patches == {"mini": 64, "tiny": 16}[name]
    assert profile.vision_hidden_size == {"mini": 128, "tiny": 32}[name]
    assert profile.threshold_input_size == profile.vision_hidden_size + profile.text_hidden_size + 3


def test_a_profile_whose_dino_grid_is_finer_than_clips_is_refused():
    tiny = get_pruning_profile("tiny")
    with pytest.raises(ValueError, match="must not be finer than the CLIP grid"):
        PruningProfile(
            name="tiny",
            text=tiny.text,
            dino={**tiny.dino, "patch_size": 4},
            dino_image_size=32,  # 8×8 DINO grid against tiny's 4×4 CLIP grid
            projection_dim=8,
            sensitivity_hidden=(8,),
            threshold_hidden=(8,),
        )
