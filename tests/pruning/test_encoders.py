"""The frozen encoders: seeded random towers for the small profiles, real ones from local folders only."""

import time

import pytest
import torch
from transformers import CLIPConfig, CLIPModel, Dinov2Model

from pruning import (
    build_random_encoders,
    get_pruning_profile,
    load_encoders,
    load_pretrained_encoders,
)
from pruning.encoders import clip_text_config, dino_config
from vlm.loading import ModelNotAvailableError
from vlm.mini.tokenizer import build_word_tokenizer


def test_outputs_have_the_profiles_shapes_and_no_gradient(encoders, profile, samples):
    vectors = encoders.encode_questions([sample.question for sample in samples[:3]])
    patches = encoders.encode_images([sample.image for sample in samples[:3]])
    assert vectors.shape == (3, profile.text_hidden_size)
    assert patches.shape == (3, profile.dino_grid**2, profile.dino_hidden_size)
    assert not vectors.requires_grad and not patches.requires_grad
    assert not any(parameter.requires_grad for parameter in encoders.parameters())


def test_a_question_vector_does_not_depend_on_its_batch(encoders):
    """Pooling reads each question's own end-of-text state, whatever the padding around it."""
    short, long = "what shape is this?", "is there a blue circle or a red triangle in the image?"
    alone = encoders.encode_questions([short])
    torch.testing.assert_close(encoders.encode_questions([long, short])[1], alone[0])
    assert not torch.allclose(encoders.encode_questions([long])[0], alone[0])


def test_a_too_long_question_is_truncated_to_the_towers_positions(encoders):
    question = " ".join(["shape"] * 200)
    assert encoders.encode_questions([question]).shape == (1, encoders.profile.text_hidden_size)


def test_random_encoders_are_seeded_and_the_fingerprint_tells_them_apart(profile, tokenizer, encoders):
    again = build_random_encoders(profile, tokenizer)
    assert again.fingerprint == encoders.fingerprint
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), encoders.state_dict().values()))
    assert build_random_encoders(profile, tokenizer, seed=1).fingerprint != encoders.fingerprint
    other_words = build_word_tokenizer(["an entirely different vocabulary"])
    assert build_random_encoders(profile, other_words).fingerprint != encoders.fingerprint


def test_profiles_without_checkpoints_build_random_encoders_even_when_real_ones_are_asked_for(profile, tokenizer):
    assert load_encoders(profile, tokenizer=tokenizer, random_weights=False).fingerprint == (
        build_random_encoders(profile, tokenizer).fingerprint
    )


def test_missing_real_encoders_fail_fast_with_download_instructions(tmp_path, tokenizer):
    profile = get_pruning_profile("llava-1.5-7b")
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailableError) as raised:
        load_pretrained_encoders(profile, cache_dir=tmp_path)  # an empty HF cache
    assert time.perf_counter() - started < 1.0
    message = str(raised.value)
    assert "hf download openai/clip-vit-large-patch14-336 --local-dir DIR" in message
    assert "pruning.text_source" in message
    with pytest.raises(ModelNotAvailableError, match="hf download facebook/dinov2-small --local-dir DIR"):
        load_pretrained_encoders(profile, text_source=_clip_checkpoint(tmp_path / "clip", tokenizer), dino_source=tmp_path / "none")


def _clip_checkpoint(folder, tokenizer, profile_name: str = "mini"):
    """A full CLIPModel checkpoint (text + vision, as the openai repos ship it) with its tokenizer."""
    profile = get_pruning_profile(profile_name)
    text = clip_text_config(
        profile,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16)
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision, projection_dim=text.projection_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = CLIPModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_real_encoders_load_from_local_folders(tmp_path, tokenizer, samples):
    """The real-weight path, on generated checkpoints of the mini sizes: same outputs as the models saved."""
    profile = get_pruning_profile("mini")
    clip_folder = _clip_checkpoint(tmp_path / "clip", tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        dino = Dinov2Model(dino_config(profile))
    dino.save_pretrained(tmp_path / "dino")
    loaded = load_pretrained_encoders(profile, text_source=clip_folder, dino_source=tmp_path / "dino")
    reference = build_random_encoders(profile, tokenizer)
    reference.text_model.load_state_dict(CLIPModel.from_pretrained(clip_folder).text_model.state_dict())
    reference.dino.load_state_dict(dino.state_dict())
    questions = [sample.question for sample in samples[:4]]
    torch.testing.assert_close(loaded.encode_questions(questions), reference.encode_questions(questions))
    images = [sample.image for sample in samples[:2]]
    torch.testing.assert_close(loaded.encode_images(images), reference.encode_images(images))


def test_real_encoders_of_the_wrong_size_are_refused(tmp_path, tokenizer):
    clip_folder = _clip_checkpoint(tmp_path / "clip", tokenizer, profile_name="tiny")
    Dinov2Model(dino_config(get_pruning_profile("mini"))).save_pretrained(tmp_path / "dino")
    with pytest.raises(ValueError, match="CLIP text hidden size is 16, but pruning profile 'mini' expects 64"):
        load_pretrained_encoders(get_pruning_profile("mini"), text_source=clip_folder, dino_source=tmp_path / "dino")
