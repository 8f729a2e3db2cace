"""Policies "fastv" and "sparsevlm": who reads the image decides which tokens stay (the papers' rules)."""

import pytest
import torch

import pruning.policies.attention as attention
from config import ConfigError, load_config
from pruning import build_policy, get_policy, policy_options
from pruning.policies import PolicyContext
from registry import OptionError
from training.model import RANDOM_IMAGE_ID, RANDOM_PAD_ID, RANDOM_VOCAB_SIZE
from vlm.loading import build_random_model
from vlm.lora import apply_lora, lora_parameters
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import TINY
from vlm.segments import merge_multimodal_inputs, project_visual_features
from vqa import build_prompt, load_vqa


@pytest.fixture(scope="module")
def sample():
    return load_vqa("easyvqa", "train", limit=1)[0]


@pytest.fixture(scope="module")
def tokenizer(sample):
    return build_sample_tokenizer([sample])


def tiny(seed: int = 0):
    model = build_random_model(TINY, seed=seed, vocab_size=RANDOM_VOCAB_SIZE, image_token_id=RANDOM_IMAGE_ID,
                               pad_token_id=RANDOM_PAD_ID)
    return apply_lora(model, rank=4)


def selector(policy: str, model, tokenizer, ratio: float, layer: int = 0, client_layers: int | None = None):
    options = policy_options(get_policy(policy), {"ratio": ratio, "attention_layer": layer})
    return build_policy(policy, PolicyContext(profile="tiny", options=options, model=model, tokenizer=tokenizer,
                                              instruction=None, client_layers=client_layers))


def test_fastv_keeps_what_every_token_attends_to_sparsevlm_what_the_question_does(monkeypatch, sample, tokenizer):
    """A hand-made attention map: the image's own rows all look at visual token 0; the first
    question token (a rater: it pays the image more than the question tokens do on average) looks
    at tokens 5 and 6; the second pays token 7 a little (below the mean: not a rater)."""
    model = tiny()
    features = torch.randn(1, TINY.num_patches, TINY.vision_hidden_size)
    prompt = torch.tensor(tokenizer(build_prompt(sample.question, instruction=None), add_special_tokens=False)
                          ["input_ids"])
    inputs = merge_multimodal_inputs(model, [prompt], list(project_visual_features(model, features)))
    visual = inputs.visual_token_mask[0].nonzero().flatten()
    first_text = int(visual.max()) + 1
    length = inputs.attention_mask.shape[1]
    assert length - first_text >= 4, "the question needs a few tokens for the mean to exclude one"
    weights = torch.zeros(1, 2, length, length)
    weights[0, :, visual, visual[0]] = 1.0
    weights[0, :, first_text, visual[5]], weights[0, :, first_text, visual[6]] = 0.6, 0.3
    weights[0, :, first_text + 1, visual[7]] = 0.1
    monkeypatch.setattr(attention, "decoder_attention", lambda *args: weights)
    fastv = selector("fastv", model, tokenizer, ratio=1 - 2 / TINY.num_patches)(features, [sample]).keep[0]
    sparse = selector("sparsevlm", model, tokenizer, ratio=1 - 2 / TINY.num_patches)(features, [sample]).keep[0]
    assert fastv.tolist() == [0, 5]
    assert sparse.tolist() == [5, 6]


@pytest.mark.parametrize("policy", ["fastv", "sparsevlm"])
def test_the_ranking_is_the_public_bases_whatever_the_clients_adapters_learned(policy, sample, tokenizer):
    model = tiny()
    features = torch.randn(3, TINY.num_patches, TINY.vision_hidden_size, generator=torch.Generator().manual_seed(1))
    samples = [sample] * 3
    before = selector(policy, model, tokenizer, ratio=0.75, layer=1)(features, samples).keep
    with torch.no_grad():
        for name, parameter in lora_parameters(model).items():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter))
    after = selector(policy, model, tokenizer, ratio=0.75, layer=1)(features, samples).keep
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert {len(k) for k in before} == {4}
    if policy == "sparsevlm":
        # Other features, other attention: the ranking reads the image. (A random model attends
        # almost uniformly, so FastV's average over every row ranks by how many rows come after a
        # token, the causal mask's order, whatever the image.)
        other = selector(policy, model, tokenizer, ratio=0.75, layer=1)(torch.randn_like(features), samples).keep
        assert any(not torch.equal(a, b) for a, b in zip(before, other, strict=True))


def test_the_layer_must_be_one_the_client_runs(sample, tokenizer):
    # The tiny USL client runs decoder layer 0 only (split.cut_a = 1); SL's runs 0 and 1.
    with pytest.raises(ConfigError, match=r"pruning.attention_layer=1 .*0\.\.0"):
        load_config({"output.name": "a", "model.profile": "tiny", "paradigm": "usl", "pruning.policy": "fastv",
                     "pruning.ratio": 0.5, "pruning.attention_layer": 1})
    load_config({"output.name": "a", "model.profile": "tiny", "paradigm": "sl", "pruning.policy": "fastv",
                 "pruning.ratio": 0.5, "pruning.attention_layer": 1})
    with pytest.raises(OptionError, match="attention_layer"):
        selector("sparsevlm", tiny(), tokenizer, ratio=0.5, layer=1, client_layers=1)
    with pytest.raises(ValueError, match="needs the model and its tokenizer"):
        build_policy("fastv", PolicyContext(profile="tiny"))
