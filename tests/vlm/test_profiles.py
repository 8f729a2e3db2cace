import re

import pytest

from vlm.cuts import LayerSegment, segment_of_owner, split_layers
from vlm.profiles import MINI, TINY, Profile, build_llava_config, get_profile

SMALL_VISION = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)


def small_profile(num_layers: int, **fields) -> Profile:
    text = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=num_layers, num_attention_heads=2)
    return Profile(name="test", vision=SMALL_VISION, text=text, image_size=16, patch_size=4, image_token_id=1, **fields)


@pytest.mark.parametrize(
    "name, num_patches, num_layers, sl_cut, usl_cuts, k_min",
    [
        ("llava-1.5-7b", 576, 32, 16, (8, 24), 16),
        ("mini", 64, 8, 4, (2, 6), 2),
        ("tiny", 16, 4, 2, (1, 3), 1),
    ],
)
def test_profile_numbers(name, num_patches, num_layers, sl_cut, usl_cuts, k_min):
    profile = get_profile(name)
    assert (profile.num_patches, profile.num_layers) == (num_patches, num_layers)
    assert (profile.sl_cut, profile.usl_cuts, profile.k_min) == (sl_cut, usl_cuts, k_min)


def test_llava_7b_config_is_the_real_architecture():
    config = build_llava_config(get_profile("llava-1.5-7b"))
    vision, text = config.vision_config, config.text_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (1024, 24, 16)
    assert (vision.intermediate_size, vision.image_size, vision.patch_size) == (4096, 336, 14)
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (4096, 32, 32)
    assert (text.intermediate_size, text.vocab_size, text.rms_norm_eps) == (11008, 32064, 1e-5)
    assert (config.image_token_id, text.pad_token_id) == (32000, 32001)
    assert (config.vision_feature_layer, config.vision_feature_select_strategy) == (-2, "default")
    assert (config.projector_hidden_act, config.image_seq_length) == ("gelu", 576)
    assert get_profile("llava-1.5-7b").hf_id == "llava-hf/llava-1.5-7b-hf"


def test_unknown_profile_names_value_and_known_names():
    with pytest.raises(ValueError, match="no model profile named 'llava-13b'; registered: llava-1.5-7b, mini, "
                                         "mini-positional, mini-interleaved, mini-scenes, tiny"):
        get_profile("llava-13b")


def test_default_cuts_and_k_min_follow_the_paper_proportions():
    profile = small_profile(12)
    assert (profile.sl_cut, profile.usl_cuts) == (6, (3, 9))
    assert profile.k_min == 1  # ceil(16/576 * 16 patches)


@pytest.mark.parametrize("sl_cut", [0, 8, -1])
def test_invalid_sl_cut_names_value_and_range(sl_cut):
    with pytest.raises(ValueError, match=rf"sl_cut={sl_cut} .*0 < sl_cut < 8"):
        small_profile(8, sl_cut=sl_cut)


@pytest.mark.parametrize("usl_cuts", [(0, 4), (4, 4), (5, 3), (2, 8)])
def test_invalid_usl_cuts_name_value_and_range(usl_cuts):
    with pytest.raises(ValueError, match=re.escape(f"usl_cuts={usl_cuts!r}") + ".*" + re.escape("0 < CA < CB < 8")):
        small_profile(8, usl_cuts=usl_cuts)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("vision_feature_select_strategy", "cls", "allowed: \\('default', 'full'\\)"),
        ("vision_feature_layer", 3, "vision_feature_layer=3 is out of range \\[-3, 2\\]"),
        ("k_min", 17, "k_min=17 is out of range \\[1, 16\\]"),
    ],
)
def test_invalid_profile_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        small_profile(4, **{field: value})


def test_mini_needs_its_tokenizer_vocabulary():
    with pytest.raises(ValueError, match="pass vocab_size, image_token_id, pad_token_id"):
        build_llava_config(MINI)
    config = build_llava_config(MINI, vocab_size=100, image_token_id=98, pad_token_id=99)
    assert (config.text_config.vocab_size, config.image_token_id, config.text_config.pad_token_id) == (100, 98, 99)
    assert config.image_seq_length == MINI.num_patches


def test_token_ids_must_lie_in_the_vocabulary():
    with pytest.raises(ValueError, match=r"image_token_id=64 is outside the vocabulary \[0, 64\)"):
        build_llava_config(TINY, image_token_id=64)


@pytest.mark.parametrize(
    "cuts, expected",
    [
        ((), [("all", 0, 8)]),
        ((3,), [("client", 0, 3), ("server", 3, 8)]),
        ((2, 6), [("head", 0, 2), ("body", 2, 6), ("tail", 6, 8)]),
    ],
)
def test_split_layers(cuts, expected):
    segments = split_layers(8, cuts)
    assert [(s.owner, s.start, s.stop) for s in segments] == expected
    assert [s.is_last for s in segments] == [False] * (len(expected) - 1) + [True]
    assert segment_of_owner(segments, expected[0][0]) == segments[0]
    assert 0 in segments[0] and 8 not in segments[-1]


def test_split_layers_rejects_three_cuts_and_unknown_owner():
    with pytest.raises(ValueError, match="has 3 entries; allowed: 0"):
        split_layers(8, (1, 2, 3))
    with pytest.raises(ValueError, match=r"owner='server' is not part of this split; allowed: \['head'"):
        segment_of_owner(split_layers(8, (2, 6)), "server")
    assert isinstance(split_layers(8, ())[0], LayerSegment)
