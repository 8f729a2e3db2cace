"""Pruning policies from the registry: what each keeps, how it ranks, and the artefacts it reads."""

import math
from dataclasses import replace

import pytest
import torch

from pruning import (
    ArtifactError,
    FrozenEncoders,
    KeepAll,
    PolicyContext,
    PolicySpec,
    RatioOptions,
    build_policy,
    build_qpriv_vl,
    get_policy,
    keep_count,
    load_dtp,
    oracle_key,
    policy_names,
    policy_options,
    register_policy,
    save_dtp,
    save_oracle,
    sensitivity_exclusion_ratios,
)
from vlm.mini.tokenizer import build_word_tokenizer

PAPER_GRID = (0.3, 0.5, 0.7, 0.9)
# Policy name and its fixed ratio (None where the policy ignores it).
POLICIES = [("off", None), *[("fixed", ratio) for ratio in PAPER_GRID], ("dtp", None), ("oracle", None),
            ("random", 0.5), ("dart", 0.7)]
# The policies that rank by a QPriv-VL module (the others keep by a rule of their own).
SCORED = ("fixed", "dtp", "oracle")


def oracle_ratios(samples) -> dict[str, float]:
    """A different ratio per sample, including 1.0 (the oracle's "no ratio kept the answer")."""
    return {oracle_key(sample): min(1.0, 0.1 * (index % 11)) for index, sample in enumerate(samples)}


@pytest.fixture
def artifacts(tmp_path, profile, encoders, samples):
    """A "trained" module (seed 11) and an oracle table searched with scorer seed 12."""
    save_dtp(tmp_path, build_qpriv_vl(profile, seed=11), encoders)
    save_oracle(tmp_path, oracle_ratios(samples), build_qpriv_vl(profile, seed=12), encoders)
    return tmp_path


@pytest.fixture
def context(profile, tokenizer, samples, artifacts):
    def make(ratio: float = 0.0, **overrides) -> PolicyContext:
        settings = dict(profile=profile.name, tokenizer=tokenizer, samples=samples, artifacts=artifacts,
                        options=RatioOptions(ratio) if ratio else None)
        return PolicyContext(**{**settings, **overrides})

    return make


def options_for(policy: str, ratio: float | None):
    """The policy's own options with its budget at `ratio` (None: its defaults)."""
    return policy_options(get_policy(policy), {"ratio": ratio}) if ratio else None


def features_for(profile, batch: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, profile.num_patches, profile.vision_hidden_size, generator=generator)


def test_the_registry_holds_the_papers_policies_first():
    assert policy_names()[:4] == ["off", "fixed", "dtp", "oracle"]
    with pytest.raises(ValueError, match="already registered"):
        register_policy(PolicySpec("off", lambda context: KeepAll()))
    with pytest.raises(ValueError, match="no pruning policy named 'nonexistent'; registered: off, fixed, dtp, oracle"):
        build_policy("nonexistent", PolicyContext(profile="tiny"))


@pytest.mark.parametrize(("policy", "ratio"), POLICIES)
def test_every_policy_keeps_ascending_indices_as_many_as_its_ratio_says(policy, ratio, context, profile, samples):
    selector = build_policy(policy, context(options=options_for(policy, ratio)))
    batch = samples[:6]
    features = features_for(profile, len(batch))
    keep = selector(features, batch).keep
    if policy == "off":
        counts = [profile.num_patches] * len(batch)
    elif get_policy(policy).budget == "ratio":
        counts = [keep_count(ratio, profile.num_patches, profile.k_min)] * len(batch)
    elif policy == "dtp":
        predicted = selector.score(features, batch).ratio
        counts = [keep_count(float(rho), profile.num_patches, profile.k_min) for rho in predicted]
    else:
        table = oracle_ratios(samples)
        counts = [keep_count(table[oracle_key(sample)], profile.num_patches, profile.k_min) for sample in batch]
    assert [len(indices) for indices in keep] == counts
    for indices in keep:
        assert indices.dtype == torch.long and indices.device == features.device
        assert torch.equal(indices, indices.unique(sorted=True))  # ascending, no repeats
        assert 0 <= int(indices.min()) and int(indices.max()) < profile.num_patches
        assert len(indices) >= profile.k_min


def test_the_fixed_papers_grid_keeps_fewer_tokens_as_the_ratio_grows(context, profile, samples):
    counts = [len(build_policy("fixed", context(ratio=ratio))(features_for(profile, 1), samples[:1]).keep[0]) for ratio in PAPER_GRID]
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == len(counts)


def test_the_oracle_keeps_k_min_where_no_ratio_kept_the_answer(context, profile, samples):
    table = oracle_ratios(samples)
    hopeless = [sample for sample in samples if table[oracle_key(sample)] == 1.0]
    assert hopeless
    keep = build_policy("oracle", context())(features_for(profile, len(hopeless)), hopeless).keep
    assert {len(indices) for indices in keep} == {profile.k_min}


@pytest.mark.parametrize("policy", SCORED)
def test_scored_policies_keep_the_top_of_their_modules_fused_score(policy, context, profile, samples):
    selector = build_policy(policy, context(ratio=0.5 if policy == "fixed" else 0.0))
    batch, features = samples[:4], features_for(profile, 4)
    scores = selector.score(features, batch).score
    for indices, row in zip(selector(features, batch).keep, scores, strict=True):
        pruned = torch.ones_like(row, dtype=torch.bool)
        pruned[indices] = False
        if pruned.any():
            assert row[indices].min() >= row[pruned].max()


def test_which_module_each_policy_ranks_with(context, profile, encoders, samples, artifacts):
    batch, features = samples[:3], features_for(profile, 3)

    def score(selector):
        return selector.score(features, batch).score

    trained = load_dtp(artifacts, profile, encoders, alpha=1.0, beta=1.0)
    inputs = build_policy("dtp", context()).inputs
    by_trained = trained(features, inputs.question_vectors(batch), inputs.dino_patches(batch)).score
    torch.testing.assert_close(score(build_policy("dtp", context())), by_trained)
    torch.testing.assert_close(score(build_policy("fixed", context(ratio=0.5))), by_trained)
    untrained = build_policy("fixed", context(ratio=0.5, artifacts=None, seed=5))
    seeded = build_qpriv_vl(profile, seed=5)(features, inputs.question_vectors(batch), inputs.dino_patches(batch))
    torch.testing.assert_close(score(untrained), seeded.score)
    oracle_scorer = build_qpriv_vl(profile, seed=12)
    searched = oracle_scorer(features, inputs.question_vectors(batch), inputs.dino_patches(batch)).score
    torch.testing.assert_close(score(build_policy("oracle", context())), searched)


def test_alpha_zero_prunes_the_most_sensitive_patches(context, profile, samples):
    selector = build_policy("fixed", context(ratio=0.5, alpha=0.0, artifacts=None))
    batch, features = samples[:4], features_for(profile, 4)
    selection = selector(features, batch)
    sensitivity, keep = selection.sensitivity, selection.keep
    for row, indices in zip(sensitivity, keep, strict=True):
        pruned = torch.ones_like(row, dtype=torch.bool)
        pruned[indices] = False
        assert row[pruned].min() >= row[indices].max()
    assert all(ratio >= 1 for ratio in sensitivity_exclusion_ratios(sensitivity, keep))


@pytest.mark.parametrize(("policy", "ratio"), POLICIES)
def test_one_pass_of_the_module_gives_the_keep_indices_and_the_sensitivity_map(policy, ratio, context, profile, samples):
    selector = build_policy(policy, context(options=options_for(policy, ratio)))
    batch, features = samples[:3], features_for(profile, 3)
    if policy not in SCORED:
        assert selector(features, batch).sensitivity is None
        return
    passes = []
    selector.scorer.register_forward_hook(lambda module, args, output: passes.append(output))
    selection = selector(features, batch)
    assert len(passes) == 1
    torch.testing.assert_close(selection.sensitivity, passes[0].sensitivity, rtol=0, atol=0)


def test_bf16_features_are_scored_in_the_modules_precision(context, profile, samples):
    selector = build_policy("fixed", context(ratio=0.5))
    features = features_for(profile, 2)
    assert [k.tolist() for k in selector(features.bfloat16(), samples[:2]).keep] == [
        k.tolist() for k in selector(features.bfloat16().float(), samples[:2]).keep
    ]


@pytest.mark.parametrize("policy", ["dtp", "oracle"])
def test_policies_that_need_artefacts_say_which_file(policy, context, tmp_path):
    expected = {"dtp": "dtp.pt", "oracle": "oracle.pt"}[policy]
    for folder in (None, tmp_path / "empty"):
        with pytest.raises(ArtifactError, match=f"needs {expected} in the prepared artefacts folder"):
            build_policy(policy, context(artifacts=folder))


@pytest.mark.parametrize("policy", ["dtp", "oracle"])
@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"alpha": 0.0}, "alpha"), ({"beta": 2.0}, "beta"), ("other tokenizer", "encoders")],
)
def test_artefacts_made_for_other_settings_are_refused(policy, overrides, field, context):
    if overrides == "other tokenizer":
        overrides = {"tokenizer": build_word_tokenizer(["other words entirely"])}
    with pytest.raises(ArtifactError, match=f"was made with {field}="):
        build_policy(policy, context(**overrides))


def test_the_oracle_names_samples_it_has_no_ratio_for(context, profile, samples):
    stranger = replace(samples[0], id="never-searched")
    selector = build_policy("oracle", context())
    with pytest.raises(KeyError, match="no ratio for samples \\['easyvqa/train/never-searched'\\]"):
        selector(features_for(profile, 1), [stranger])


def test_oracle_ratios_outside_zero_one_are_refused(tmp_path, profile, encoders):
    with pytest.raises(ValueError, match="oracle ratios must lie in \\[0, 1\\]"):
        save_oracle(tmp_path, {"a": 1.5, "b": math.nan}, build_qpriv_vl(profile, seed=0), encoders)


def test_frozen_inputs_are_encoded_once_and_then_read_from_disk(context, samples, tmp_path, monkeypatch):
    path = tmp_path / "pruning-inputs.pt"
    first = build_policy("fixed", context(ratio=0.5, cache_path=path))
    assert path.is_file()

    def encode_again(*args, **kwargs):
        raise AssertionError("a cached input was encoded again")

    monkeypatch.setattr(FrozenEncoders, "encode_images", encode_again)
    monkeypatch.setattr(FrozenEncoders, "encode_questions", encode_again)
    again = build_policy("fixed", context(ratio=0.5, cache_path=path))
    assert torch.equal(again.inputs.dino_patches(samples), first.inputs.dino_patches(samples))


def test_fixed_with_an_artefacts_folder_needs_the_trained_module_there(context, tmp_path):
    with pytest.raises(ArtifactError, match="'fixed' needs dtp.pt"):
        build_policy("fixed", context(ratio=0.5, artifacts=tmp_path / "empty"))
