"""Trained towers (pruning.towers): training improves both objectives, builds are cached,
resumable and deterministic, and load_encoders picks them only for profiles that name them."""

import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from pruning import (
    TowerRecipe,
    TowerSource,
    build_qpriv_vl,
    build_random_encoders,
    get_pruning_profile,
    load_encoders,
    load_trained_encoders,
    pruning_profile_names,
    train_towers,
)
from pruning.towers import (
    DINO_FILE,
    REPORT_FILE,
    TEXT_FILE,
    adopt_readout,
    mini_tower_source,
    relevance_recall,
    towers_folder,
)
from vlm.loading import ModelNotAvailableError, build_random_model, clip_image_preprocessor
from vlm.mini.build import CACHE_ENV, SHIPPED_ROOT, MiniFolder
from vlm.mini.recipe import recipe_for
from vlm.segments import llava_parts
from vlm.mini.tokenizer import build_word_tokenizer
from vqa import load_vqa

RECIPE = TowerRecipe(
    dataset="scenes",
    samples=48,
    text_epochs=4,
    text_batch_size=16,
    text_lr=3e-3,
    dino_epochs=4,
    dino_batch_size=8,
    dino_lr=3e-3,
)


@pytest.fixture(scope="module")
def profile():
    """The tiny profile with towers: 32-px model, 4×4 CLIP grid, 2×2 DINO grid."""
    return replace(get_pruning_profile("tiny"), towers=RECIPE)


@pytest.fixture(scope="module")
def source(profile):
    samples = list(load_vqa("scenes", "train", limit=RECIPE.samples, seed=RECIPE.seed))
    tokenizer = build_word_tokenizer([f"{sample.question} {sample.answer}" for sample in samples])
    model = build_random_model(
        profile.model,
        seed=0,
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
        pad_token_id=tokenizer.pad_token_id,
    ).eval()
    return TowerSource(model, clip_image_preprocessor(profile.model.image_size), tokenizer, samples, "tiny test model")


@pytest.fixture(scope="module")
def built(profile, source, tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return root, train_towers(profile, source, root=root, progress=False)


def test_only_the_scene_testbed_trains_its_towers():
    assert [name for name in pruning_profile_names() if get_pruning_profile(name).towers is not None] == ["mini-scenes"]
    for name in ("mini", "mini-positional", "mini-interleaved", "tiny"):
        assert get_pruning_profile(name).towers is None


def test_training_improves_both_objectives(built):
    import json

    _, folder = built
    report = json.loads((folder / REPORT_FILE).read_text())
    text, dino = report["stages"]["text"], report["stages"]["dino"]
    assert text["after"]["bce"] < text["before"]["bce"]
    assert text["epoch_losses"][-1] < text["epoch_losses"][0]
    assert dino["after"]["mse"] < dino["before"]["mse"]
    assert dino["epoch_losses"][-1] < dino["epoch_losses"][0]


def test_a_build_is_cached_and_reloads_the_same_encoders(profile, source, built):
    root, folder = built
    files = {name: (folder / name).stat().st_mtime_ns for name in (TEXT_FILE, DINO_FILE)}
    assert train_towers(profile, source, root=root, progress=False) == folder
    assert {name: (folder / name).stat().st_mtime_ns for name in files} == files
    first = load_trained_encoders(profile, source=source, root=root)
    again = load_trained_encoders(profile, source=source, root=root)
    assert first.fingerprint == again.fingerprint
    assert first.fingerprint != build_random_encoders(profile, source.tokenizer).fingerprint
    assert first.relevance_readout is not None and first.vision_digest is not None
    questions = ["What shape is in the top left?"]
    torch.testing.assert_close(first.encode_questions(questions), again.encode_questions(questions))


def test_training_is_deterministic_and_resumes_one_tower(profile, source, built, tmp_path):
    _, folder = built
    other = train_towers(profile, source, root=tmp_path, progress=False)
    assert other.name == folder.name
    for name in (TEXT_FILE, DINO_FILE):
        assert (other / name).read_bytes() == (folder / name).read_bytes()
    # An interrupted build (only the DINO stand-in saved) trains the question tower alone, to the same weights.
    (other / TEXT_FILE).unlink()
    dino_written = (other / DINO_FILE).stat().st_mtime_ns
    train_towers(profile, source, root=tmp_path, progress=False)
    assert (other / DINO_FILE).stat().st_mtime_ns == dino_written
    expected, resumed = load_file(folder / TEXT_FILE), load_file(other / TEXT_FILE)
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)


def test_the_key_follows_the_recipe_and_the_vision_tower(profile, source, built):
    root, folder = built
    assert towers_folder(replace(profile, towers=replace(RECIPE, text_epochs=5)), source, root) != folder
    other_model = build_random_model(
        profile.model,
        seed=1,
        vocab_size=len(source.tokenizer),
        image_token_id=source.tokenizer.convert_tokens_to_ids(source.tokenizer.image_token),
        pad_token_id=source.tokenizer.pad_token_id,
    )
    assert towers_folder(profile, replace(source, model=other_model), root) != folder


def test_load_encoders_picks_trained_towers_for_a_profile_that_names_them(profile, source, built, monkeypatch):
    root, _ = built
    monkeypatch.setenv(CACHE_ENV, str(root))
    trained = load_trained_encoders(profile, source=source, root=root)
    picked = load_encoders(profile, tokenizer=source.tokenizer, random_weights=False, tower_source=source)
    assert picked.fingerprint == trained.fingerprint
    # A random-weight model still gets random encoders; the plain tiny profile keeps its random towers.
    random = load_encoders(profile, tokenizer=source.tokenizer, random_weights=True, tower_source=source)
    assert random.relevance_readout is None and random.fingerprint != trained.fingerprint
    plain = load_encoders(get_pruning_profile("tiny"), tokenizer=source.tokenizer, random_weights=False)
    assert plain.relevance_readout is None
    assert plain.fingerprint == build_random_encoders(get_pruning_profile("tiny"), source.tokenizer).fingerprint


def test_a_missing_build_fails_naming_the_command_that_builds_it(profile, source, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="qpriv-prune towers --profile tiny"):
        load_encoders(profile, tokenizer=source.tokenizer, random_weights=False, tower_source=source)
    assert not any(tmp_path.iterdir())
    # The scene testbed's towers need its model's build first, and say so.
    scenes = get_pruning_profile("mini-scenes")
    with pytest.raises(ModelNotAvailableError, match="qpriv-mini build --profile mini-scenes") as raised:
        load_encoders(scenes, tokenizer=source.tokenizer, random_weights=False)
    assert "qpriv-prune towers --profile mini-scenes" in str(raised.value)
    with pytest.raises(ModelNotAvailableError):
        mini_tower_source(scenes)


def test_a_build_installed_from_shipped_weights_gives_the_towers_their_vision_tower(tmp_path, monkeypatch):
    """Shipped weights hold the base stage, not the vision stage: its frozen tower is the same."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    scenes = get_pruning_profile("mini-scenes")
    folder = MiniFolder(recipe_for("mini-scenes"))
    shipped = SHIPPED_ROOT / folder.path.name
    folder.path.mkdir(parents=True)
    shutil.copytree(shipped / "tokenizer", folder.tokenizer)
    shutil.copy(shipped / folder.base.name, folder.base)
    assert not folder.vision.exists()
    source = mini_tower_source(scenes)
    base = load_file(folder.base)
    tower = llava_parts(source.model).vision_tower.state_dict()
    assert all(torch.equal(tower[name], base[f"model.vision_tower.{name}"]) for name in tower)


def test_another_tokenizer_is_refused(profile, source, built):
    root, _ = built
    other = build_word_tokenizer(["an entirely different vocabulary"])
    with pytest.raises(ValueError, match="another vocabulary"):
        load_trained_encoders(profile, tokenizer=other, source=source, root=root)


def test_a_module_adopts_the_pretrained_relevance_pair(profile, source, built):
    root, _ = built
    encoders = load_trained_encoders(profile, source=source, root=root)
    module = build_qpriv_vl(profile, seed=0)
    assert adopt_readout(module, encoders)
    vision = torch.randn(3, profile.num_patches, profile.vision_hidden_size)
    question = torch.randn(3, profile.text_hidden_size)
    torch.testing.assert_close(module.relevance(vision, question), torch.sigmoid(encoders.relevance_readout(vision, question)))
    random = build_random_encoders(profile, source.tokenizer)
    untouched = build_qpriv_vl(profile, seed=0)
    assert not adopt_readout(untouched, random)
    assert torch.equal(untouched.query_projection.weight, build_qpriv_vl(profile, seed=0).query_projection.weight)


def test_relevance_recall_counts_needed_patches_in_the_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    needed = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    recall = relevance_recall(logits, needed)
    assert recall["count"] == 2
    assert recall["micro"] == pytest.approx(3 / 4)
    assert recall["mean"] == pytest.approx((1.0 + 0.5) / 2)


def test_prepare_reads_trained_towers_only_with_a_trained_model():
    from pruning.prepare import PrepareSettings, _random_encoders

    assert not _random_encoders(PrepareSettings(profile="mini-scenes"))
    assert _random_encoders(PrepareSettings(profile="mini-scenes", model_stage="random"))
    assert _random_encoders(PrepareSettings(profile="mini"))


def test_auroc_counts_ties_half_and_needs_both_classes():
    from pruning.prepare import auroc

    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5, 0.2]), torch.tensor([0, 1, 0])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.3, 0.2]), torch.tensor([1, 1])) is None
