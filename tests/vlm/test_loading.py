import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from vlm import loading
from vlm.cuts import split_layers
from vlm.loading import (
    ModelBundle,
    ModelNotAvailableError,
    build_model_on_meta,
    build_random_model,
    clip_image_preprocessor,
    count_parameters,
    load_model,
    load_weights,
    locate_weights,
    register_loader,
    resolve_pretrained_source,
)
from vlm.mini.tokenizer import build_word_tokenizer
from vlm.profiles import TINY, Profile, build_llava_config, get_profile

LLAVA_7B = get_profile("llava-1.5-7b")
DOWNLOAD_HINT = "hf download llava-hf/llava-1.5-7b-hf --local-dir DIR"


def test_random_model_is_deterministic_per_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_random_model(TINY, seed=5).state_dict()
    assert torch.equal(torch.rand(1), expected_next)
    second = build_random_model(TINY, seed=5).state_dict()
    other = build_random_model(TINY, seed=6).state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


def test_random_weights_are_drawn_on_the_device_they_are_built_for():
    """Building in place is what lets a 7B random model appear on a GPU in a moment: nothing
    is drawn on the CPU and copied over (on the meta device, nothing is drawn at all)."""
    on_meta = build_random_model(LLAVA_7B, seed=5, dtype=torch.bfloat16, device="meta")
    assert {(p.device.type, p.dtype) for p in on_meta.parameters()} == {("meta", torch.bfloat16)}
    on_cpu = build_random_model(TINY, seed=5, device="cpu").state_dict()
    default = build_random_model(TINY, seed=5).state_dict()
    assert all(torch.equal(on_cpu[key], default[key]) for key in default)


def test_tiny_bundle_preprocesses_pil_images_to_the_profile_size():
    bundle = load_model("tiny", seed=0)
    assert bundle.profile is TINY and bundle.tokenizer is None
    images = [Image.fromarray(np.full((48, 40, 3), value, dtype=np.uint8)) for value in (0, 255)]
    pixel_values = bundle.preprocess_images(images)
    assert pixel_values.shape == (2, 3, TINY.image_size, TINY.image_size)
    assert pixel_values[0].mean() < 0 < pixel_values[1].mean()  # CLIP normalisation centres the range


def test_llava_7b_on_meta_has_the_papers_sizes():
    model = build_model_on_meta(LLAVA_7B)
    assert next(model.parameters()).device.type == "meta"
    counts = count_parameters(model)
    in_millions = lambda n: round(n / 1e6, 1)  # noqa: E731
    assert round(counts.total / 1e9, 3) == 7.063
    assert in_millions(counts.vision_tower) == 303.5
    assert in_millions(counts.projector) == 21.0
    assert in_millions(counts.embeddings) == 131.3
    assert in_millions(counts.lm_head) == 131.3
    assert {in_millions(n) for n in counts.decoder_layers} == {202.4}
    assert (len(counts.decoder_layers), LLAVA_7B.num_patches) == (32, 576)
    assert (LLAVA_7B.sl_cut, LLAVA_7B.usl_cuts) == (16, (8, 24))

    def by_owner(cuts: tuple[int, ...]) -> dict[str, float]:
        return {s.owner: round(counts.for_segment(s) / 1e9, 2) for s in split_layers(32, cuts)}

    # LLAVA_NOTES gives the USL head as 2.08B; the exact count is 2,074,888,192.
    assert by_owner((16,)) == {"client": 3.69, "server": 3.37}
    assert by_owner((8, 24)) == {"head": 2.07, "body": 3.24, "tail": 1.75}
    assert by_owner(()) == {"all": round(counts.total / 1e9, 2)}


def test_missing_7b_weights_fail_fast_with_instructions(tmp_path):
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailableError, match=DOWNLOAD_HINT) as raised:
        load_model("llava-1.5-7b", cache_dir=tmp_path)
    assert time.perf_counter() - started < 1.0
    assert "not in the local HF cache" in str(raised.value)


@pytest.mark.parametrize(
    "make_source, reason",
    [
        (lambda tmp: tmp, "has no config.json"),
        (lambda tmp: tmp / "missing" / "llava", "neither a checkpoint folder nor a hub id"),
    ],
    ids=["folder without config", "path that does not exist"],
)
def test_bad_local_source_is_reported(tmp_path, make_source, reason):
    with pytest.raises(ModelNotAvailableError, match=reason):
        resolve_pretrained_source(LLAVA_7B, make_source(tmp_path), cache_dir=tmp_path)


def _fake_hf_cache(cache_dir: Path, files: list[str]) -> Path:
    """The HF cache layout (refs/main -> snapshots/<commit>/...) holding the given files."""
    repo = cache_dir / "models--llava-hf--llava-1.5-7b-hf"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    return snapshot


def test_cached_config_without_weights_is_reported(tmp_path):
    _fake_hf_cache(tmp_path, ["config.json"])
    with pytest.raises(ModelNotAvailableError, match="holds 'llava-hf/llava-1.5-7b-hf'.s config but not its weights"):
        resolve_pretrained_source(LLAVA_7B, None, cache_dir=tmp_path)


def test_complete_cache_entry_resolves_to_its_snapshot_folder(tmp_path):
    snapshot = _fake_hf_cache(tmp_path, ["config.json", "model.safetensors.index.json"])
    assert resolve_pretrained_source(LLAVA_7B, None, cache_dir=tmp_path) == snapshot
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_pretrained_source(LLAVA_7B, local, cache_dir=tmp_path) == local


@pytest.fixture
def isolated_loader_registry(monkeypatch):
    monkeypatch.setattr(loading, "_LOADERS", dict(loading._LOADERS))
    monkeypatch.setattr(loading, "LAZY_LOADER_MODULES", {})


def test_registered_loader_receives_profile_and_options(isolated_loader_registry):
    received = {}

    def fake_loader(profile: Profile, **options) -> ModelBundle:
        received.update(profile=profile, **options)
        return ModelBundle(model=torch.nn.Identity(), profile=profile, tokenizer=None, preprocess_images=list)

    register_loader("tiny", fake_loader, replace=True)
    bundle = load_model(TINY, cache_dir="somewhere")
    assert received == {"profile": TINY, "cache_dir": "somewhere"}
    assert bundle.profile is TINY
    with pytest.raises(ValueError, match="already registered"):
        register_loader("tiny", fake_loader)


def test_profile_without_loader_names_registered_ones(isolated_loader_registry):
    # Another test may have imported vlm.mini, which registers the real mini loaders.
    for name in ("mini", "mini-positional", "mini-interleaved", "mini-scenes"):
        loading._LOADERS.pop(name, None)
    registered = r"\['llava-1.5-7b', 'tiny'\]"
    with pytest.raises(ValueError, match=rf"no loader registered for profile 'mini'; registered: {registered}"):
        load_model("mini")


def test_lazy_loader_module_is_imported_on_first_use(isolated_loader_registry, monkeypatch, tmp_path):
    (tmp_path / "fake_mini_loader.py").write_text(
        "from vlm.loading import register_loader, load_random\nregister_loader('mini', load_random)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_mini_loader", raising=False)
    monkeypatch.setattr(loading, "LAZY_LOADER_MODULES", {"mini": "fake_mini_loader", "tiny": "not_installed_loader"})
    monkeypatch.setattr(loading, "_LOADERS", {})
    with pytest.raises(ValueError, match="'not_installed_loader', which is not installed"):
        load_model("tiny")
    with pytest.raises(ValueError, match="pass vocab_size"):  # reached the registered loader
        load_model("mini")


def test_bundle_pickles_for_remote_workers():
    bundle = pickle.loads(pickle.dumps(load_model("tiny", seed=0)))
    assert bundle.profile == TINY
    assert bundle.preprocess_images([Image.new("RGB", (8, 8))]).shape == (1, 3, TINY.image_size, TINY.image_size)


TOKEN_IDS = {"vocab_size": 40, "image_token_id": 4, "pad_token_id": 0}


@pytest.mark.parametrize(("profile", "stage"), [("tiny", "base"), ("tiny", "vqa"), ("mini", "random")])
def test_random_weights_are_the_seeded_model_at_the_given_token_ids(profile, stage):
    bundle = load_weights(profile, stage=stage, seed=3, random_token_ids=TOKEN_IDS)
    assert bundle.tokenizer is None and bundle.profile.name == profile
    expected = build_random_model(get_profile(profile), seed=3, **TOKEN_IDS).state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in bundle.model.state_dict().items())
    assert locate_weights(profile, stage=stage) is None


def _llava_folder(folder: Path) -> Path:
    """A local checkpoint folder as `hf download llava-hf/llava-1.5-7b-hf` leaves it, at the tiny sizes."""
    tokenizer = build_word_tokenizer(["what shape is this ?"])
    stand_in = replace(LLAVA_7B, vision=TINY.vision, text=TINY.text, image_size=TINY.image_size,
                       patch_size=TINY.patch_size, vision_feature_layer=TINY.vision_feature_layer,
                       sl_cut=None, usl_cuts=None, k_min=None)
    config = build_llava_config(stand_in, vocab_size=len(tokenizer), image_token_id=4, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlavaForConditionalGeneration(config).save_pretrained(folder)
    image_processor = clip_image_preprocessor(TINY.image_size).image_processor
    LlavaProcessor(image_processor, tokenizer, patch_size=TINY.patch_size).save_pretrained(folder)
    return folder


def test_real_weights_load_from_a_local_folder_in_the_asked_dtype(tmp_path):
    folder = _llava_folder(tmp_path / "llava")
    assert locate_weights("llava-1.5-7b", stage="vqa", source=folder) == folder
    bundle = load_weights("llava-1.5-7b", stage="vqa", source=folder, dtype=torch.bfloat16)
    assert bundle.profile == LLAVA_7B and bundle.tokenizer is not None
    saved = LlavaForConditionalGeneration.from_pretrained(folder).state_dict()
    loaded = bundle.model.state_dict()
    assert all(value.dtype == torch.bfloat16 for value in loaded.values())
    assert all(torch.equal(value, saved[name].to(torch.bfloat16)) for name, value in loaded.items())
    pixel_values = bundle.preprocess_images([Image.new("RGB", (40, 40))])
    assert pixel_values.shape == (1, 3, TINY.image_size, TINY.image_size)


def test_absent_real_weights_are_found_missing_without_loading_anything(tmp_path):
    started = time.perf_counter()
    for find in (locate_weights, load_weights):
        with pytest.raises(ModelNotAvailableError, match=DOWNLOAD_HINT):
            find("llava-1.5-7b", stage="vqa", source=tmp_path / "absent")
    assert time.perf_counter() - started < 1.0
