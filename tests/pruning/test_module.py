"""QPrivVL's forward at every profile size: shapes, the formulas of SPEC §1, and the keep rule."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pruning import (
    QPrivVL,
    build_qpriv_vl,
    get_pruning_profile,
    keep_count,
    keep_indices,
)

PROFILES = ("llava-1.5-7b", "mini", "tiny")


def random_inputs(profile, batch: int = 3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, profile.num_patches, profile.vision_hidden_size, generator=generator),
        torch.randn(batch, profile.text_hidden_size, generator=generator),
        torch.randn(batch, profile.dino_grid**2, profile.dino_hidden_size, generator=generator),
    )


@pytest.mark.parametrize("name", PROFILES)
def test_forward_shapes_and_ranges_at_every_size(name):
    profile = get_pruning_profile(name)
    output = build_qpriv_vl(profile, seed=0)(*random_inputs(profile))
    batch, patches = 3, profile.num_patches
    for field in ("relevance", "sensitivity", "score", "soft_mask"):
        assert getattr(output, field).shape == (batch, patches), field
    assert output.sensitivity_dino.shape == (batch, profile.dino_grid**2)
    assert output.ratio.shape == (batch,)
    for field in ("relevance", "sensitivity_dino", "sensitivity", "soft_mask", "ratio"):
        values = getattr(output, field)
        assert ((values > 0) & (values < 1)).all(), field


@pytest.mark.parametrize("name", PROFILES)
def test_the_forward_computes_the_specified_formulas(name):
    profile = get_pruning_profile(name)
    module = build_qpriv_vl(profile, seed=1, alpha=0.7, beta=1.3)
    vision, question, dino = random_inputs(profile, seed=1)
    output = module(vision, question, dino)

    keys = vision @ module.key_projection.weight.T
    query = question @ module.query_projection.weight.T
    relevance = torch.sigmoid((keys @ query.unsqueeze(-1)).squeeze(-1) / math.sqrt(profile.projection_dim))
    torch.testing.assert_close(output.relevance, relevance)
    assert module.query_projection.bias is None and module.key_projection.bias is None

    sensitivity_dino = torch.sigmoid(module.sensitivity_head(dino).squeeze(-1))
    torch.testing.assert_close(output.sensitivity_dino, sensitivity_dino)
    grid = sensitivity_dino.reshape(3, 1, profile.dino_grid, profile.dino_grid)
    aligned = F.interpolate(grid, size=(profile.clip_grid,) * 2, mode="bilinear", align_corners=False).flatten(1)
    torch.testing.assert_close(output.sensitivity, aligned)

    torch.testing.assert_close(output.score, 0.7 * output.relevance - 1.3 * output.sensitivity)
    torch.testing.assert_close(output.soft_mask, torch.sigmoid(3.0 * output.score))

    summary = torch.stack(
        [sensitivity_dino.mean(1), sensitivity_dino.max(1).values, (sensitivity_dino > 0.5).float().mean(1)], dim=1
    )
    features = torch.cat([vision.mean(1), question, summary], dim=1)
    assert features.shape[1] == profile.threshold_input_size
    torch.testing.assert_close(output.ratio, torch.sigmoid(module.threshold_head(features).squeeze(-1)))


def test_sensitivity_heads_use_gelu_between_linear_layers():
    head = build_qpriv_vl(get_pruning_profile("llava-1.5-7b"), seed=0).sensitivity_head
    assert [type(layer).__name__ for layer in head] == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    assert [layer.out_features for layer in head if isinstance(layer, torch.nn.Linear)] == [128, 128, 1]


def test_alpha_zero_ranks_by_sensitivity_alone():
    profile = get_pruning_profile("mini")
    inputs = random_inputs(profile)
    privacy_only = build_qpriv_vl(profile, seed=0, alpha=0.0)(*inputs)
    torch.testing.assert_close(privacy_only.score, -privacy_only.sensitivity)


def test_a_dino_grid_equal_to_the_clip_grid_is_passed_through_unchanged():
    tiny = get_pruning_profile("tiny")
    same_grid = replace(tiny, dino={**tiny.dino, "patch_size": 8})  # 4×4, as CLIP's
    assert same_grid.dino_grid == same_grid.clip_grid
    sensitivity = torch.rand(2, same_grid.num_patches)
    torch.testing.assert_close(QPrivVL(same_grid).align(sensitivity), sensitivity)


def test_every_trainable_part_gets_a_gradient_and_gamma_starts_at_three():
    profile = get_pruning_profile("tiny")
    module = build_qpriv_vl(profile, seed=0)
    assert isinstance(module.gamma, torch.nn.Parameter) and module.gamma.item() == 3.0
    output = module(*random_inputs(profile))
    (output.soft_mask.sum() + output.ratio.sum()).backward()
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in module.parameters())
    assert "alpha" not in module.state_dict() and "gamma" in module.state_dict()


def test_the_same_seed_builds_the_same_module():
    profile = get_pruning_profile("mini")
    first, second, other = (build_qpriv_vl(profile, seed=seed).state_dict() for seed in (4, 4, 5))
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


@pytest.mark.parametrize(
    ("ratio", "patches", "k_min", "expected"),
    [
        (0.0, 576, 16, 576),
        (0.3, 576, 16, 403),  # round(403.2)
        (0.5, 576, 16, 288),
        (0.9, 576, 16, 58),  # round(57.6)
        (0.98, 576, 16, 16),  # round(11.52) = 12, floored at k_min
        (1.0, 576, 16, 16),  # the oracle's "nothing matched"
        (0.7, 64, 2, 19),  # round(19.2)
        (0.99, 64, 2, 2),
        (0.9, 16, 1, 2),  # round(1.6)
        (0.5, 17, 1, 8),  # 8.5 rounds half to even
    ],
)
def test_keep_count_is_the_rounded_share_with_the_k_min_floor(ratio, patches, k_min, expected):
    assert keep_count(ratio, patches, k_min) == expected


@pytest.mark.parametrize("ratio", [-0.1, 1.5, math.nan])
def test_keep_count_refuses_a_ratio_outside_zero_one(ratio):
    with pytest.raises(ValueError, match="outside"):
        keep_count(ratio, 64, 2)


def test_keep_indices_are_each_samples_ascending_top_k():
    score = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.2], [5.0, 4.0, 3.0, 2.0, 1.0]])
    keep = keep_indices(score, [0.4, 0.8], k_min=2)
    assert [indices.tolist() for indices in keep] == [[1, 2, 3], [0, 1]]  # k = 3, then max(2, 1)
    assert all(indices.dtype == torch.long for indices in keep)
    with pytest.raises(ValueError, match="3 prune ratios for a batch of 2"):
        keep_indices(score, [0.1, 0.2, 0.3], k_min=1)
