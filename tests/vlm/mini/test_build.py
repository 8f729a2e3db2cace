"""The build pipeline on a few optimisation steps: stages, caching, resume, loading, determinism."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from vlm.loading import ModelNotAvailableError, load_model
from vlm.lora import lora_parameters
from vlm.mini import MiniFolder, MiniRecipe, build_mini, load_mini

QUICK = MiniRecipe(
    vision_steps=2, vision_batch_size=4, base_steps=2, base_batch_size=4, vqa_steps=2, vqa_batch_size=4
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    # Module-scoped, so the autouse single-thread fixture has not run yet; builds are
    # only bit-identical at the same thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cache")
    yield build_mini(QUICK, root=root, progress=False), root
    torch.set_num_threads(threads)


def test_every_stage_is_recorded_with_its_time(built):
    folder, _ = built
    report = folder.read_report()
    assert list(report["stages"]) == ["vision", "features", "base", "vqa"]
    assert all(stage["seconds"] >= 0 for stage in report["stages"].values())
    assert report["recipe"]["vision_steps"] == 2
    for path in (folder.tokenizer, folder.vision, folder.features, folder.base, folder.lora):
        assert path.exists(), path


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
    assert not lora_parameters(base.model)
    assert lora_parameters(tuned.model)
    assert base.tokenizer.image_token == "<image>"
    assert all(not p.requires_grad for n, p in tuned.model.named_parameters() if "lora_" not in n)


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


def test_changing_the_recipe_changes_the_cache_folder(tmp_path):
    assert MiniFolder(QUICK, tmp_path).path != MiniFolder(MiniRecipe(seed=1), tmp_path).path
