"""Policy "visionzip": dominant tokens by the CLS row's attention, the rest merged into evenly
spaced contextual tokens by key similarity (VisionZip's rule), and what a merged row sends."""

import pytest
import torch

from config import ConfigError, load_config
from pruning import build_policy, get_policy, keep_count, policy_options
from pruning.metrics import PruningRecord
from pruning.policies import PolicyContext, Selection
from pruning.policies.visionzip import visionzip_mixing
from registry import OptionError
from training.model import RANDOM_IMAGE_ID, RANDOM_PAD_ID, RANDOM_VOCAB_SIZE
from vlm.loading import build_random_model, clip_image_preprocessor
from vlm.profiles import TINY
from vlm.segments import feature_layer_attention, llava_parts, vision_features


def test_dominant_tokens_are_the_cls_rows_top_and_the_rest_merge_into_evenly_spaced_targets():
    """Eight patches; the CLS row attends most to 6, 1 and 3. Of the five left (0, 2, 4, 5, 7) two
    contextual targets are taken every ⌊5/2⌋ = 2nd: 0 and 4. Patch 2's key is like 0's, 5's and
    7's like 4's: each target sends its own row plus the mean of the rows assigned to it."""
    cls = torch.tensor([0.01, 0.3, 0.02, 0.2, 0.03, 0.04, 0.35, 0.05])
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.0, 1.0],
                         [0.0, 1.0], [0.1, 1.0], [1.0, 0.0], [-0.1, 1.0]])
    keep, weights = visionzip_mixing(cls, keys, count=5, contextual_share=0.4)
    assert keep.tolist() == [0, 1, 3, 4, 6]
    expected = torch.zeros(5, 8)
    expected[1, 1] = expected[2, 3] = expected[4, 6] = 1.0  # dominant: sent as they are
    expected[0, 0], expected[0, 2] = 1.0, 1.0  # target 0 + the mean of {2}
    expected[3, 4], expected[3, 5], expected[3, 7] = 1.0, 0.5, 0.5  # target 4 + the mean of {5, 7}
    assert torch.equal(weights, expected)
    # With no contextual share it is a top-k of the CLS attention, sent unmerged.
    keep, weights = visionzip_mixing(cls, keys, count=3, contextual_share=0.0)
    assert keep.tolist() == [1, 3, 6] and torch.equal(weights, torch.eye(8)[[1, 3, 6]])


def test_at_least_one_token_is_dominant():
    keep, weights = visionzip_mixing(torch.arange(6.0), torch.randn(6, 3), count=1, contextual_share=0.9)
    assert keep.tolist() == [5] and torch.equal(weights, torch.eye(6)[[5]])


def test_a_merged_selection_sends_mixed_rows_and_counts_merged_patches_as_sent():
    grid = torch.arange(12.0).view(1, 4, 3)
    mixing = [torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])]
    selection = Selection([torch.tensor([0, 2])], mixing=mixing)
    assert torch.equal(selection.rows(grid)[0], torch.stack([grid[0, 0], grid[0, 2] + grid[0, 3]]))
    assert selection.sources()[0].tolist() == [0, 2, 3]
    sent = selection.sent_grid(grid)
    assert torch.equal(sent[0, selection.keep[0]], selection.rows(grid)[0]) and torch.equal(grid, torch.arange(12.0).view(1, 4, 3))
    # A mark on patches 1 and 3: 3 is merged into a sent row, so only 1 is removed.
    record = PruningRecord.of_batch(selection.keep, 4, marks=[(1, 3)], sources=selection.sources())
    assert (record.mark_patches, record.mark_patches_removed) == (2, 1)


@pytest.fixture(scope="module")
def tiny():
    return build_random_model(TINY, seed=0, vocab_size=RANDOM_VOCAB_SIZE, image_token_id=RANDOM_IMAGE_ID,
                              pad_token_id=RANDOM_PAD_ID)


def test_the_cls_attention_is_the_vision_layers_own(tiny):
    """Read from the layer's projections, it matches the eager attention weights CLIP returns for the
    layer whose output LLaVA reads."""
    pixels = torch.randn(2, 3, TINY.image_size, TINY.image_size, generator=torch.Generator().manual_seed(0))
    parts = llava_parts(tiny)
    tower = parts.vision_tower
    tower.config._attn_implementation = "eager"
    layer = parts.config.vision_feature_layer % (len(tower.encoder.layers) + 1) - 1
    with torch.no_grad():
        attentions = tower(pixels, output_attentions=True).attentions
        read = feature_layer_attention(tiny, pixels)
    assert torch.allclose(read.cls, attentions[layer][:, :, 0, 1:].sum(1), atol=1e-5)
    assert read.keys.shape[:2] == (2, TINY.num_patches)


def test_the_policy_keeps_its_budget_from_the_vision_towers_attention(tiny):
    from vqa import load_vqa

    samples = list(load_vqa("easyvqa", "train", limit=3))
    preprocess = clip_image_preprocessor(TINY.image_size)

    def pixel_values(batch):
        return preprocess([sample.image for sample in batch])

    options = policy_options(get_policy("visionzip"), {"ratio": 0.75})
    selector = build_policy("visionzip", PolicyContext(profile="tiny", options=options, model=tiny,
                                                       pixel_values=pixel_values))
    with torch.no_grad():
        features = vision_features(tiny, pixel_values(samples))
    selection = selector(features, samples)
    count = keep_count(0.75, TINY.num_patches, 1)
    assert {len(keep) for keep in selection.keep} == {count}
    read = feature_layer_attention(tiny, pixel_values(samples))
    contextual = round(count * options.contextual_share)
    for keep, cls in zip(selection.keep, read.cls, strict=True):
        dominant = set(cls.topk(count - contextual).indices.tolist())
        assert dominant <= set(keep.tolist())
    # Every patch's content is sent, in a kept or a merged row.
    assert contextual > 0 and all(len(sources) == TINY.num_patches for sources in selection.sources())


def test_it_needs_the_model_and_its_preprocessing():
    with pytest.raises(ValueError, match="pixel_values"):
        build_policy("visionzip", PolicyContext(profile="tiny"))


def test_a_contextual_share_outside_0_1_is_refused():
    with pytest.raises(OptionError, match="contextual_share"):
        policy_options(get_policy("visionzip"), {"contextual_share": 1.0}).validate()


def test_the_vision_edges_defenses_refuse_a_merging_policy():
    run = {"output.name": "a", "model.profile": "tiny", "paradigm": "usl", "pruning.policy": "visionzip",
           "pruning.ratio": 0.5}
    load_config(run)
    with pytest.raises(ConfigError, match="pruning.policy.*shuffle"):
        load_config({**run, "privacy.defenses": "shuffle"})
