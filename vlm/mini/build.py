"""Build the mini model once, stage by stage, into a cache folder; load it back.

Each finished stage is saved before the next starts, so an interrupted build
resumes at the stage it was in. The folder is keyed by the recipe's fingerprint.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file, save_model
from safetensors.torch import load_model as load_weights_into
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from vlm.features import VisionFeatureCache
from vlm.loading import ModelBundle, ModelNotAvailableError, build_random_model, clip_image_preprocessor
from vlm.lora import apply_lora
from vlm.mini.attributes import image_attributes
from vlm.mini.recipe import MiniRecipe, SceneRecipe, recipe_for
from vlm.mini.scene_stages import patch_labels, pretrain_scene_vision, train_scene_decoder
from vlm.mini.stages import BaseComparisonStalled, instruction_texts, pretrain_vision, train_base, train_vqa_lora
from vlm.mini.tokenizer import build_word_tokenizer
from vlm.profiles import MINI, MINI_SCENES, Profile
from vlm.segments import llava_parts
from vqa import build_prompt, get_adapter, load_vqa
from vqa.adapters.scenes import split_scenes

CACHE_ENV = "QPRIV_CACHE_DIR"
STAGES = ("base", "vqa")
BUILD_COMMAND = "qpriv-mini build"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "qpriv-vl")).expanduser()


class MiniFolder:
    """The files of one mini-model build."""

    def __init__(self, recipe: "MiniRecipe | SceneRecipe", root: Path | None = None, *, name: str | None = None) -> None:
        self.recipe = recipe
        self.path = (root or cache_root()) / "mini" / recipe.fingerprint() if name is None else (root or cache_root()) / name
        self.tokenizer = self.path / "tokenizer"
        self.vision = self.path / "stage1_vision.safetensors"
        self.features = self.path / "vision_features.pt"
        self.base = self.path / "stage2_base.safetensors"
        self.lora = self.path / "stage3_vqa_lora.safetensors"
        self.report = self.path / "build.json"

    def read_report(self) -> dict:
        return json.loads(self.report.read_text()) if self.report.is_file() else {"stages": {}}

    def write_report(self, report: dict) -> None:
        self.report.write_text(json.dumps(report, indent=2))


def _new_model(tokenizer: PreTrainedTokenizerFast, seed: int, profile: Profile = MINI,
               init_std: float | None = None) -> torch.nn.Module:
    """A randomly initialised model of `profile` for `tokenizer`; `init_std` replaces the text
    config's initializer_range (projector, decoder, embeddings) when given."""
    if init_std is not None:
        profile = dataclasses.replace(profile, text={**profile.text, "initializer_range": init_std})
    return build_random_model(
        profile,
        seed=seed,
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
        pad_token_id=tokenizer.pad_token_id,
    )


# Built weights that ship with the code, one folder per recipe fingerprint (tokenizer, base, VQA
# LoRA, build.json): a newcomer's first run installs them in seconds instead of training for
# half an hour, and `qpriv-mini build --from-scratch` rebuilds them to check the digest.
SHIPPED_ROOT = Path(__file__).parent / "shipped"
SHIPPED_FILES = ("tokenizer", "stage2_base.safetensors", "stage3_vqa_lora.safetensors", "build.json")


class ShippedWeightsCorrupt(RuntimeError):
    """Shipped weights whose digest is not the one their build recorded (a torn or altered file)."""


def shipped_folder(recipe: "MiniRecipe | SceneRecipe") -> Path | None:
    path = SHIPPED_ROOT / recipe.fingerprint()
    return path if (path / "build.json").is_file() else None


def install_shipped(recipe: "MiniRecipe | SceneRecipe", folder: "MiniFolder") -> bool:
    """Copy the shipped build of `recipe` into `folder` after checking its digest; False when none ships."""
    shipped = shipped_folder(recipe)
    if shipped is None:
        return False
    report = json.loads((shipped / "build.json").read_text())
    staging = folder.path.with_name(f".{folder.path.name}.installing")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(shipped, staging)
    got = weights_digest(MiniFolder(recipe, staging.parent, name=staging.name))
    if got != report.get("weights_digest"):
        shutil.rmtree(staging, ignore_errors=True)
        raise ShippedWeightsCorrupt(
            f"the shipped weights in {shipped} have digest {got}, but their build recorded "
            f"{report.get('weights_digest')}: a file is torn or altered. Restore it from git "
            f"(git checkout -- {shipped}) or build from scratch with `{BUILD_COMMAND} --from-scratch`."
        )
    report["installed_from"] = str(shipped.relative_to(SHIPPED_ROOT.parents[2]))
    (staging / "build.json").write_text(json.dumps(report, indent=2))
    for name in SHIPPED_FILES:
        target = folder.path / name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    shutil.rmtree(staging, ignore_errors=True)
    return True


def ship(recipe: "MiniRecipe | SceneRecipe", root: Path | None = None) -> Path:
    """Copy the finished build of `recipe` from the cache into SHIPPED_ROOT (to commit with the code)."""
    folder = MiniFolder(recipe, root)
    missing = [name for name in SHIPPED_FILES if not (folder.path / name).exists()]
    if missing:
        raise ModelNotAvailableError(f"nothing to ship: {folder.path} lacks {', '.join(missing)}; build it first")
    target = SHIPPED_ROOT / recipe.fingerprint()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in SHIPPED_FILES:
        copy = shutil.copytree if (folder.path / name).is_dir() else shutil.copy2
        copy(folder.path / name, target / name)
    return target


class MiniBuildFailed(RuntimeError):
    """A stage's own check failed on every attempt; what was built before it is kept."""


def _reinitialise_language_side(model: torch.nn.Module, fresh: torch.nn.Module) -> None:
    """Projector, decoder and LM head from `fresh` (another seed); the trained vision tower stays."""
    parts, fresh_parts = llava_parts(model), llava_parts(fresh)
    for name in ("projector", "language_model", "lm_head"):
        getattr(parts, name).load_state_dict(getattr(fresh_parts, name).state_dict())


def _stage(folder: MiniFolder, report: dict, name: str, output: Path, work: Callable[[], dict],
           load: Callable[[Path], object] | None = None) -> None:
    """Run one build stage unless its output exists (then `load` it): a stopped build resumes at
    the stage it stopped in, and each stage's seconds and outcome reach build.json when it ends."""
    if output.exists():
        if load is not None:
            load(output)
        return
    started = time.perf_counter()
    outcome = work()
    report["stages"][name] = {"seconds": round(time.perf_counter() - started, 1), **outcome}
    folder.write_report(report)


def _finish(folder: MiniFolder, report: dict) -> MiniFolder:
    report["total_seconds"] = round(sum(s["seconds"] for s in report["stages"].values()), 1)
    report["weights_digest"] = weights_digest(folder)
    folder.write_report(report)
    return folder


def build_mini(
    recipe: MiniRecipe | SceneRecipe = MiniRecipe(), *, root: Path | None = None, progress: bool = True,
    from_scratch: bool = False,
) -> MiniFolder:
    """Build (or finish building) the mini model; returns its folder. Seconds per stage go to build.json.

    A recipe whose weights ship with the code (`shipped_folder`) is installed from them, digest
    checked, unless `from_scratch`."""
    folder = MiniFolder(recipe, root)
    folder.path.mkdir(parents=True, exist_ok=True)
    if not from_scratch and not _complete(folder) and install_shipped(recipe, folder):
        return folder
    if isinstance(recipe, SceneRecipe):
        return build_scenes(recipe, root=root, progress=progress)
    report = folder.read_report()
    report["recipe"] = asdict(recipe)
    torch.manual_seed(recipe.seed)
    train, test = load_vqa("easyvqa", "train"), load_vqa("easyvqa", "test")
    if not folder.tokenizer.is_dir():
        texts = [build_prompt(s.question, recipe.instruction) + " " + s.answer for s in train]
        texts += [build_prompt(question, recipe.instruction) for question in instruction_texts(recipe)]
        build_word_tokenizer(texts).save_pretrained(folder.tokenizer)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder.tokenizer)
    model = _new_model(tokenizer, recipe.seed)
    preprocess = clip_image_preprocessor(MINI.image_size)
    attributes = image_attributes(train)

    def vision_stage() -> dict:
        image_ids = sorted(attributes)
        first_sample = {s.image_id: s for s in reversed(train)}
        pixels = preprocess([first_sample[i].image for i in image_ids])
        loss = pretrain_vision(model, pixels, [attributes[i] for i in image_ids], recipe, progress=progress)
        save_model(model, folder.vision)
        return {"final_loss": loss}

    _stage(folder, report, "vision", folder.vision, vision_stage, load=partial(load_weights_into, model))
    features = VisionFeatureCache(model, preprocess)

    def feature_stage() -> dict:
        features.add([*train, *test], progress=progress)
        features.save(folder.features)
        return {}

    _stage(folder, report, "features", folder.features, feature_stage, load=features.load)

    def base_stage() -> dict:
        attempts = []
        for seed in range(recipe.seed, recipe.seed + recipe.base_attempts):
            if seed != recipe.seed:
                _reinitialise_language_side(model, _new_model(tokenizer, seed))
            try:
                attempt = train_base(model, tokenizer, features, train, recipe, seed=seed, progress=progress)
            except BaseComparisonStalled as stalled:
                attempts.append(asdict(stalled.attempt))
                retry = seed < recipe.seed + recipe.base_attempts - 1
                next_step = "starting again from a fresh initialisation" if retry else "no tries left"
                tqdm.write(f"{stalled}; {next_step}")
                continue
            attempts.append(asdict(attempt))
            save_model(model, folder.base)
            return {"final_loss": attempt.final_loss, "attempts": attempts}
        return {"attempts": attempts}

    _stage(folder, report, "base", folder.base, base_stage, load=partial(load_weights_into, model))
    if not folder.base.is_file():
        last_seed = recipe.seed + recipe.base_attempts - 1
        raise MiniBuildFailed(
            f"the base stage did not learn to compare a named attribute with the image in "
            f"base_attempts={recipe.base_attempts} attempts (seeds {recipe.seed}..{last_seed}; each one's checks "
            f"are in {folder.report}). The vision stage is kept in {folder.path}; from Python, build a recipe "
            "with more attempts or another seed, e.g. build_mini(MiniRecipe(base_attempts=5))."
        )

    def vqa_stage() -> dict:
        peft_model, loss = train_vqa_lora(model, tokenizer, features, list(train), recipe, progress=progress)
        save_file(get_peft_model_state_dict(peft_model), folder.lora)
        return {"final_loss": loss}

    _stage(folder, report, "vqa", folder.lora, vqa_stage)
    return _finish(folder, report)


def _complete(folder: MiniFolder) -> bool:
    return folder.tokenizer.is_dir() and folder.base.is_file() and folder.lora.is_file()


def build_scenes(recipe: SceneRecipe, *, root: Path | None = None, progress: bool = True) -> MiniFolder:
    """Build (or finish building) the scene testbed's model (vlm/mini/scene_stages.py) in
    `recipe.threads` torch threads, so that two builds of one recipe are identical."""
    folder = MiniFolder(recipe, root)
    folder.path.mkdir(parents=True, exist_ok=True)
    report = folder.read_report()
    report["recipe"] = asdict(recipe)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        torch.manual_seed(recipe.seed)
        spec = get_adapter(recipe.dataset).spec
        if spec.image_size != MINI_SCENES.image_size:
            raise ValueError(f"{recipe.dataset} images are {spec.image_size} px; the model reads {MINI_SCENES.image_size}")
        if recipe.train_split not in spec.splits:
            raise ValueError(f"train_split={recipe.train_split!r}: {recipe.dataset} has the splits {', '.join(spec.splits)}")

        splits = {split: load_vqa(recipe.dataset, split) for split in spec.splits}
        if not folder.tokenizer.is_dir():
            texts = [build_prompt(s.question, recipe.instruction) + " " + s.answer for rows in splits.values() for s in rows]
            build_word_tokenizer(texts).save_pretrained(folder.tokenizer)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder.tokenizer)
        model = _new_model(tokenizer, recipe.seed, MINI_SCENES, init_std=recipe.decoder_init_std)
        preprocess = clip_image_preprocessor(MINI_SCENES.image_size)

        load = partial(load_weights_into, model)

        def vision_stage() -> dict:
            scenes = split_scenes(spec, recipe.train_split)
            pixels = preprocess([scene.render() for scene in scenes])
            labels = patch_labels(scenes, spec, MINI_SCENES.patch_size)
            loss = pretrain_scene_vision(model, pixels, labels, spec, recipe, progress=progress)
            save_model(model, folder.vision)
            return {"final_loss": loss}

        _stage(folder, report, "vision", folder.vision, vision_stage, load=load)
        features = VisionFeatureCache(model, preprocess)

        def feature_stage() -> dict:
            features.add([s for rows in splits.values() for s in rows], progress=progress)
            features.save(folder.features)
            return {}

        _stage(folder, report, "features", folder.features, feature_stage, load=features.load)
        train = list(splits[recipe.train_split])

        def base_stage() -> dict:
            _, loss = train_scene_decoder(model, tokenizer, features, train, recipe, stage="base", progress=progress)
            save_model(model, folder.base)
            return {"final_loss": loss}

        _stage(folder, report, "base", folder.base, base_stage, load=load)

        def vqa_stage() -> dict:
            peft_model, loss = train_scene_decoder(model, tokenizer, features, train, recipe, stage="vqa", progress=progress)
            save_file(get_peft_model_state_dict(peft_model), folder.lora)
            return {"final_loss": loss}

        _stage(folder, report, "vqa", folder.lora, vqa_stage)
    finally:
        torch.set_num_threads(threads)
    return _finish(folder, report)


def weights_digest(folder: MiniFolder) -> str:
    """sha256 over the built weight files (base, then VQA LoRA): what a result was measured on,
    beside the recipe that was meant to make it."""
    digest = hashlib.sha256()
    for path in (folder.base, folder.lora):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def weights_identity(profile: str, root: Path | None = None) -> str:
    """What a result names as its mini weights: `<profile> recipe <fingerprint>, weights <digest>`,
    or that the profile is not built here."""
    recipe = recipe_for(profile)
    folder = MiniFolder(recipe, root)
    if not _complete(folder):
        return f"{profile} recipe {recipe.fingerprint()}, not built"
    digest = folder.read_report().get("weights_digest") or weights_digest(folder)
    return f"{profile} recipe {recipe.fingerprint()}, weights {digest}"


def load_mini(
    profile: Profile = MINI,
    *,
    stage: str = "vqa",
    recipe: MiniRecipe | None = None,
    root: Path | None = None,
) -> ModelBundle:
    """The built mini model: `stage="base"` before the VQA LoRA stage, `"vqa"` after it, its
    LoRA merged into the weights (a plain model, as every stage is: a run then puts its own
    LoRA on it, which on a still-wrapped model would replace this one); `recipe` defaults to
    the profile's (recipe.RECIPES)."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}; allowed: {STAGES}")
    recipe = recipe or recipe_for(profile.name)
    folder = MiniFolder(recipe, root)
    needed = [folder.tokenizer, folder.base] + ([folder.lora] if stage == "vqa" else [])
    missing = [path.name for path in needed if not path.exists()]
    if missing and install_shipped(recipe, folder):
        missing = []
    if missing:
        raise ModelNotAvailableError(
            f"the mini model ({stage} stage) is not built in {folder.path} (missing: {', '.join(missing)}). "
            f"Build it once with `{BUILD_COMMAND}{'' if profile.name == MINI.name else f' --profile {profile.name}'}` (about 13 minutes on 2 idle CPU cores; set {CACHE_ENV} to "
            "build elsewhere)."
        )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder.tokenizer)
    model = _new_model(tokenizer, recipe.seed, profile)
    load_weights_into(model, folder.base)
    if stage == "vqa":
        model = apply_lora(model, rank=recipe.lora_rank)
        set_peft_model_state_dict(model, load_file(folder.lora))
        model = model.merge_and_unload()
    return ModelBundle(
        model=model.eval(),
        profile=profile,
        tokenizer=tokenizer,
        preprocess_images=clip_image_preprocessor(profile.image_size),
    )
