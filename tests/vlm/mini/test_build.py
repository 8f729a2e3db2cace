"""The build pipeline on a few optimisation steps: stages, caching, resume, loading, determinism."""

import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from vlm.loading import ModelNotAvailableError, build_random_model, load_model
from vlm.lora import lora_parameters
from vlm.mini import MiniFolder, MiniRecipe, build_mini, load_mini
from vlm.mini.build import MiniBuildFailed, _reinitialise_language_side
from vlm.profiles import TINY
from vlm.segments import llava_parts

QUICK = MiniRecipe(
    vision_steps=2, vision_batch_size=4, base_steps=2, base_batch_size=4, vqa_steps=2, vqa_batch_size=4,
    base_check_every=1, base_check_images=8, base_check_accuracy=0.0, base_few_tokens_max_steps=2,
)
# A few optimisation steps cannot answer every check question right.
NEVER_LEARNS = replace(QUICK, base_check_accuracy=1.0, base_few_tokens_max_steps=3, base_attempts=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return build_mini(QUICK, root=root, progress=False), root


def test_every_stage_is_recorded_with_its_time(built):
    folder, _ = built
    report = folder.read_report()
    assert list(report["stages"]) == ["vision", "features", "base", "vqa"]
    assert all(stage["seconds"] >= 0 for stage in report["stages"].values())
    assert report["recipe"]["vision_steps"] == 2
    for path in (folder.tokenizer, folder.vision, folder.features, folder.base, folder.lora):
        assert path.exists(), path
    (attempt,) = report["stages"]["base"]["attempts"]
    assert attempt["seed"] == 0 and attempt["learned_at_step"] == 1 and attempt["few_token_steps"] == 2
    assert list(attempt["yes_no_checks"]) == ["1", "2"]
    assert 0.0 <= attempt["final_yes_no"] <= 1.0


def test_a_base_that_never_learns_the_comparison_is_retried_then_fails_clearly(built, tmp_path):
    folder, _ = built
    stalls = MiniFolder(NEVER_LEARNS, tmp_path)
    stalls.path.mkdir(parents=True)
    # The check settings do not touch the vision stage, so its outputs carry over.
    shutil.copytree(folder.tokenizer, stalls.tokenizer)
    for path in (folder.vision, folder.features):
        shutil.copy(path, stalls.path / path.name)
    with pytest.raises(MiniBuildFailed, match=r"base_attempts=2 attempts \(seeds 0..1"):
        build_mini(NEVER_LEARNS, root=tmp_path, progress=False)
    attempts = stalls.read_report()["stages"]["base"]["attempts"]
    assert [a["seed"] for a in attempts] == [0, 1]
    # Planned: 2 few-token steps; the failed check at step 2 extends the phase to the maximum, 3.
    assert all(list(a["yes_no_checks"]) == ["1", "2", "3"] for a in attempts)
    assert all(a["learned_at_step"] is None and max(a["yes_no_checks"].values()) < 1.0 for a in attempts)
    assert stalls.vision.is_file() and not stalls.base.exists()


def test_a_fresh_start_reinitialises_the_language_side_and_keeps_the_vision_tower():
    model, fresh = build_random_model(TINY, seed=0), build_random_model(TINY, seed=1)
    vision_before = {n: p.clone() for n, p in llava_parts(model).vision_tower.named_parameters()}
    _reinitialise_language_side(model, fresh)
    parts, fresh_parts = llava_parts(model), llava_parts(fresh)
    assert all(torch.equal(p, vision_before[n]) for n, p in parts.vision_tower.named_parameters())
    for name in ("projector", "language_model", "lm_head"):
        fresh_state = getattr(fresh_parts, name).state_dict()
        assert all(torch.equal(t, fresh_state[k]) for k, t in getattr(parts, name).state_dict().items())


def test_a_finished_build_is_reused_not_retrained(built):
    folder, root = built
    before = {path: path.stat().st_mtime_ns for path in (folder.vision, folder.base, folder.lora)}
    build_mini(QUICK, root=root, progress=False)
    assert {path: path.stat().st_mtime_ns for path in before} == before


def test_an_interrupted_build_resumes_at_the_missing_stage(built, tmp_path):
    folder, root = built
    copy = MiniFolder(QUICK, tmp_path)
    copy.path.parent.mkdir(parents=True)
    shutil.copytree(folder.path, copy.path)
    copy.lora.unlink()
    vision_time = copy.vision.stat().st_mtime_ns
    build_mini(QUICK, root=tmp_path, progress=False)
    assert copy.lora.is_file()
    assert copy.vision.stat().st_mtime_ns == vision_time
    assert load_file(copy.lora).keys() == load_file(folder.lora).keys()


def test_stages_load_through_the_profile_registry(built):
    _, root = built
    base = load_model("mini", stage="base", recipe=QUICK, root=root)
    tuned = load_model("mini", stage="vqa", recipe=QUICK, root=root)
    # The VQA stage is the base with its LoRA merged in: a plain model whose decoder projections
    # moved, so a run's own LoRA goes on it without replacing the stage's.
    assert not lora_parameters(base.model) and not lora_parameters(tuned.model)
    base_state, tuned_state = base.model.state_dict(), tuned.model.state_dict()
    assert base_state.keys() == tuned_state.keys()
    changed = [name for name in base_state if not torch.equal(base_state[name], tuned_state[name])]
    assert changed and all(".layers." in name and "vision" not in name for name in changed)
    assert base.tokenizer.image_token == "<image>"
    assert all(not p.requires_grad for p in tuned.model.parameters())


def test_the_same_seed_builds_the_same_weights(built, tmp_path):
    folder, _ = built
    again = build_mini(QUICK, root=tmp_path, progress=False)
    first, second = load_file(folder.base), load_file(again.base)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert all(torch.equal(a, b) for a, b in zip(load_file(folder.lora).values(), load_file(again.lora).values()))


def test_a_missing_build_says_how_to_make_it(tmp_path):
    with pytest.raises(ModelNotAvailableError, match="qpriv-mini build"):
        load_mini(stage="base", recipe=QUICK, root=tmp_path)


def test_an_unknown_stage_is_rejected_with_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match="stage='final'.*'base', 'vqa'"):
        load_mini(stage="final", recipe=QUICK, root=tmp_path)


def test_an_interleaved_base_trains_on_multi_image_conversations(tmp_path, monkeypatch):
    """The all-token steps of an interleaved recipe are in-context conversations (demonstrations,
    then a target), and its uninformative questions are in the vocabulary."""
    from vlm.mini import stages

    conversations = []

    def counted(model, tokenizer, visual, turns, instruction):
        conversations.extend(turns)
        return learn_in_context(model, tokenizer, visual, turns, instruction)

    learn_in_context = stages._in_context_loss
    monkeypatch.setattr(stages, "_in_context_loss", counted)
    interleaved = replace(QUICK, base_interleaved_share=1.0, base_few_tokens_share=0.0, base_few_tokens_max_steps=0)
    build_mini(interleaved, root=tmp_path, progress=False)
    assert len(conversations) == interleaved.base_steps  # one conversation per step at this batch size
    assert all(2 <= len(turns) <= interleaved.base_interleaved_max_demos + 1 for turns in conversations)
    tokenizer = load_mini(stage="base", recipe=interleaved, root=tmp_path).tokenizer
    assert tokenizer.unk_token_id not in tokenizer(interleaved.interleaved_hidden_questions[0])["input_ids"]


def test_changing_the_recipe_changes_the_cache_folder(tmp_path):
    assert MiniFolder(QUICK, tmp_path).path != MiniFolder(MiniRecipe(seed=1), tmp_path).path


def test_the_positional_profile_is_the_mini_architecture_built_with_its_own_recipe(tmp_path):
    from vlm.mini import RECIPES, recipe_for
    from vlm.profiles import MINI, MINI_POSITIONAL

    assert {f: getattr(MINI_POSITIONAL, f) for f in ("vision", "text", "image_size", "patch_size", "usl_cuts")} == {
        f: getattr(MINI, f) for f in ("vision", "text", "image_size", "patch_size", "usl_cuts")}
    assert recipe_for("mini").vision_position_loss_weight == 0
    assert recipe_for("mini-positional").vision_position_loss_weight > 0
    assert MiniFolder(RECIPES["mini-positional"], tmp_path).path != MiniFolder(RECIPES["mini"], tmp_path).path
    # Loaded by name through the registry, from its own folder, and built by its own command.
    with pytest.raises(ModelNotAvailableError, match=r"qpriv-mini build --profile mini-positional") as missing:
        load_model("mini-positional", stage="base", root=tmp_path)
    assert recipe_for("mini-positional").fingerprint() in str(missing.value)
    with pytest.raises(ValueError, match="no mini recipe for profile 'tiny'"):
        recipe_for("tiny")
