"""The scene testbed's build on a few steps of a small generated set: its stages, its local rows,
its digest (two builds of one recipe are identical), and shipped weights installed and checked."""

import shutil
from dataclasses import replace

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from vlm.mini import SceneRecipe, build_mini, load_mini
from vlm.mini import build as build_module
from vlm.mini.build import MiniFolder, ShippedWeightsCorrupt, _new_model, ship, weights_digest, weights_identity
from vlm.profiles import get_profile
from vlm.segments import llava_parts, vision_features
from vqa import SceneSpec, get_adapter, registry
from vqa.adapters.scenes import ScenesAdapter

DATASET = "scenes-build-test"
QUICK = SceneRecipe(dataset=DATASET, vision_steps=2, vision_batch_size=4, base_steps=2, base_batch_size=2,
                    base_subset_batch_size=2, vqa_steps=2)


@pytest.fixture(scope="module", autouse=True)
def small_scenes():
    # Registered for this module only: the registry's listing is asserted elsewhere.
    with pytest.MonkeyPatch.context() as patch:
        spec = SceneSpec(images=(("pretrain", 16), ("train", 2), ("aux", 2), ("test", 4)), stamp_share=0.5)
        patch.setitem(registry._ADAPTERS, DATASET, ScenesAdapter(DATASET, spec))
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_scenes):
    root = tmp_path_factory.mktemp("cache")
    return build_mini(QUICK, root=root, progress=False), root


def test_every_stage_is_recorded_with_the_weights_digest(built):
    folder, root = built
    report = folder.read_report()
    assert set(report["stages"]) == {"vision", "features", "base", "vqa"}
    assert report["weights_digest"] == weights_digest(folder)
    assert get_adapter(DATASET).spec.image_size == get_profile("mini-scenes").image_size


def test_a_train_split_the_dataset_lacks_is_named_before_any_stage(tmp_path):
    with pytest.raises(ValueError, match="train_split='validation'.*pretrain, train, aux, test"):
        build_mini(replace(QUICK, train_split="validation"), root=tmp_path, progress=False)
    assert not any(tmp_path.rglob("*.safetensors"))


def test_two_builds_of_one_recipe_have_one_digest_and_another_seed_another(built, tmp_path):
    folder, _ = built
    again = build_mini(QUICK, root=tmp_path / "again", progress=False)
    assert weights_digest(again) == weights_digest(folder)
    other = build_mini(replace(QUICK, seed=1), root=tmp_path / "other", progress=False)
    assert weights_digest(other) != weights_digest(folder)


def test_the_built_model_loads_with_local_rows(built):
    folder, root = built
    bundle = load_mini(get_profile("mini-scenes"), stage="vqa", recipe=QUICK, root=root)
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    changed = pixels.clone()
    changed[..., 8:16, 16:24] += 1.0  # patch (1, 2)
    with torch.no_grad():
        moved = (vision_features(bundle.model, pixels) - vision_features(bundle.model, changed)).abs().amax(-1)[0] > 0
    assert moved.nonzero().flatten().tolist() == [1 * 8 + 2]


def test_shipped_weights_install_with_their_digest_and_a_torn_file_is_refused(built, tmp_path, monkeypatch):
    folder, root = built
    monkeypatch.setattr(build_module, "SHIPPED_ROOT", tmp_path / "shipped")
    shipped = ship(QUICK, root=root)
    fresh = tmp_path / "fresh"
    installed = build_mini(QUICK, root=fresh, progress=False)
    assert weights_digest(installed) == weights_digest(folder)
    assert installed.read_report()["installed_from"].endswith(QUICK.fingerprint())
    assert installed.read_report()["weights_digest"] == weights_digest(folder)
    # A torn shipped file: refused naming the digests and how to restore it, nothing installed.
    data = (shipped / "stage2_base.safetensors").read_bytes()
    (shipped / "stage2_base.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ShippedWeightsCorrupt, match="torn or altered"):
        build_mini(QUICK, root=tmp_path / "torn", progress=False)
    assert not MiniFolder(QUICK, tmp_path / "torn").base.exists()


def test_an_unbuilt_profile_is_named_as_such(tmp_path):
    assert weights_identity("mini-scenes", tmp_path).endswith("not built")


def test_the_decoder_starts_at_the_recipes_init_std_and_a_bad_one_is_refused(built):
    folder, _ = built
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder.tokenizer)
    profile = get_profile("mini-scenes")

    def decoder_std(model) -> float:
        return llava_parts(model).language_model.layers[0].self_attn.q_proj.weight.std().item()

    assert decoder_std(_new_model(tokenizer, 0, profile, init_std=0.1)) == pytest.approx(0.1, rel=0.1)
    assert decoder_std(_new_model(tokenizer, 0, profile)) == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match="decoder_init_std=0"):
        SceneRecipe(decoder_init_std=0)
