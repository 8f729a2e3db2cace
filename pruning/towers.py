"""Trained question and sensitivity towers for the small profiles, and the rule that picks encoders.

At paper size QPriv-VL reads two pretrained encoders: CLIP-T, whose question vectors CLIP's
contrastive training aligned with CLIP-V's patches, and DINOv2, whose self-supervised patch
features tell content apart. The small profiles have no such checkpoints; seeded random
towers make question-guided ranking rank nothing. A profile that names `towers`
(pruning.profiles.TowerRecipe; `mini-scenes`) trains its two towers once instead:

- question tower (CLIP-T's stand-in): the CLIP text tower, jointly with a relevance read-out
  of QPriv-VL's shapes (Wq0, Wk0: encoders.RelevanceReadout), learns binary cross-entropy of
  σ(qᵀWq0ᵀWk0·K/√P) against the patches each training question needs (the data's
  `needed_boxes`), K being the frozen CLIP-V patch rows of the model's own vision tower;
- DINO stand-in: Dinov2Model learns per-patch content without any label, each patch's pixels
  reconstructed (from a noised input) by a linear read-out of its own output row, which is
  then dropped. Which content is private is learned only by H_sens from bag labels
  (pruning.prepare), as in the paper.

The towers are built under the cache root (vlm.mini.build.cache_root: QPRIV_CACHE_DIR) in
towers/<profile>-<key>/, the key digesting the profile's sizes, the recipe, the vision
tower's weights, the tokenizer and the training samples; each tower is saved when trained,
so an interrupted build resumes with the other. `qpriv-prune towers --profile NAME` builds
them; `qpriv-prune prepare` builds them on first use; a run (pruning.policies) only loads
them and otherwise fails naming that command.

The read-out is what the pretrained pair gives QPriv-VL: prepare's fixed scorer ranks with
it (its Wq/Wk are the read-out's; `adopt_readout`), so the oracle's ratios and the student's
distilled mask carry question relevance, and the student's own Wq/Wk, trained from random
as the paper's, learn it from that mask.
"""

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from safetensors.torch import load_model as load_weights_into
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR
from tqdm.auto import tqdm
from transformers import CLIPTextModel, Dinov2Model, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pruning.encoders import (
    FrozenEncoders,
    RelevanceReadout,
    build_random_encoders,
    dino_image_preprocessor,
    load_pretrained_encoders,
    pooled_question,
    question_token_ids,
    update_with_weights,
)
from pruning.module import QPrivVL
from pruning.profiles import PruningProfile
from vlm.loading import ImagePreprocessor, ModelNotAvailableError, build_random_model, clip_image_preprocessor
from vlm.mini.build import BUILD_COMMAND as MINI_BUILD_COMMAND
from vlm.mini.build import CACHE_ENV, MiniFolder, cache_root
from vlm.mini.recipe import recipe_for
from vlm.segments import llava_parts, vision_features
from vqa import VQASample, load_vqa, needed_patches

TOWERS_FOLDER = "towers"
TOWERS_COMMAND = "qpriv-prune towers"
REPORT_FILE = "towers.json"
TEXT_FILE = "text.safetensors"
DINO_FILE = "dino.safetensors"
ENCODE_BATCH = 256


@dataclass
class TowerSource:
    """What a profile's towers are trained against: the model whose vision tower gives the
    CLIP-V rows K (its `preprocess_images` feeds it), the tokenizer the text tower reads,
    and training samples that carry `needed_boxes`."""

    model: nn.Module
    preprocess_images: ImagePreprocessor
    tokenizer: PreTrainedTokenizerBase
    samples: Sequence[VQASample]
    description: str = ""


def mini_tower_source(profile: PruningProfile) -> TowerSource:
    """The profile's own mini build (its vision stage, or the base stage of a build installed
    from shipped weights: later stages keep the tower frozen) and its recipe's training samples;
    ModelNotAvailableError naming the build command when the build is missing."""
    if profile.towers is None:
        raise ValueError(f"pruning profile {profile.name!r} names no towers to train")
    try:
        recipe = recipe_for(profile.name)
    except ValueError as error:
        raise ValueError(
            f"pruning profile {profile.name!r} trains its towers against its mini build, but {error}; "
            "pass a TowerSource"
        ) from None
    folder = MiniFolder(recipe)
    # The later stages keep the tower frozen, so a build installed from shipped weights (its base
    # stage, not its vision stage) holds the same vision tower.
    weights = folder.vision if folder.vision.exists() else folder.base
    missing = [path.name for path in (folder.tokenizer, weights) if not path.exists()]
    if missing:
        raise ModelNotAvailableError(
            f"the towers of pruning profile {profile.name!r} are trained against the vision tower of the "
            f"{profile.name} model, which is not built in {folder.path} (missing: {', '.join(missing)}). "
            f"Build it with `{MINI_BUILD_COMMAND} --profile {profile.name}` (its vision stage suffices), then "
            f"the towers with `{TOWERS_COMMAND} --profile {profile.name}`."
        )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder.tokenizer)
    model = build_random_model(
        profile.model,
        seed=recipe.seed,
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
        pad_token_id=tokenizer.pad_token_id,
    )
    load_weights_into(model, weights)
    towers = profile.towers
    samples = load_vqa(towers.dataset, towers.split, limit=towers.samples or None, seed=towers.seed)
    return TowerSource(
        model.eval(),
        clip_image_preprocessor(profile.model.image_size),
        tokenizer,
        list(samples),
        description=f"{profile.name} build {folder.path}",
    )


# --- identity ---------------------------------------------------------------------------


def vision_digest(model: nn.Module) -> str:
    """The digest of a LLaVA model's vision tower weights (what K depends on)."""
    digest = hashlib.sha256()
    update_with_weights(digest, llava_parts(model).vision_tower)
    return digest.hexdigest()[:16]


def _training_samples(source: TowerSource) -> list[VQASample]:
    samples = [sample for sample in source.samples if sample.needed_boxes]
    if not samples:
        raise ValueError(
            f"the towers' training samples ({source.description or 'the tower source'}) carry no needed_boxes; "
            "train them on a benchmark that knows what each question needs (vqa.scenes)"
        )
    return samples


def towers_key(profile: PruningProfile, source: TowerSource) -> dict[str, Any]:
    """Everything that decides the trained towers (their cache key digests it)."""
    rows = [[s.id, s.image_id, s.question, [list(box) for box in s.needed_boxes]] for s in _training_samples(source)]
    vocab = json.dumps(sorted(source.tokenizer.get_vocab().items()))
    return {
        "profile": {
            "name": profile.name,
            "text": profile.text,
            "dino": profile.dino,
            "dino_image_size": profile.dino_image_size,
            "projection_dim": profile.projection_dim,
            "encoder_seed": profile.encoder_seed,
            "image_size": profile.model.image_size,
            "patch_size": profile.model.patch_size,
        },
        "recipe": asdict(profile.towers),
        "vision": vision_digest(source.model),
        "vocab": hashlib.sha256(vocab.encode()).hexdigest()[:16],
        "samples": hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16],
    }


def towers_folder(profile: PruningProfile, source: TowerSource, root: Path | None = None) -> Path:
    key = hashlib.sha256(json.dumps(towers_key(profile, source), sort_keys=True).encode()).hexdigest()[:12]
    return (root or cache_root()) / TOWERS_FOLDER / f"{profile.name}-{key}"


def _is_built(folder: Path) -> bool:
    return (folder / TEXT_FILE).is_file() and (folder / DINO_FILE).is_file()


# --- data -------------------------------------------------------------------------------


@dataclass
class TowerData:
    """The training samples' images (unique, in first-seen order), each sample's image and
    question index, its needed-patch mask on the CLIP grid, and the unique questions."""

    images: list[Image.Image]
    image_index: torch.Tensor  # [S]
    question_index: torch.Tensor  # [S]
    needed: torch.Tensor  # [S, N] float 0/1
    questions: list[str]


def needed_mask(samples: Sequence[VQASample], images: Sequence[Image.Image], image_size: int, patch_size: int) -> torch.Tensor:
    """[S, N]: 1 on the patches each sample's question needs (vqa.needed_patches), its image `images[i]`."""
    grid = image_size // patch_size
    mask = torch.zeros(len(samples), grid * grid)
    for row, (sample, image) in enumerate(zip(samples, images, strict=True)):
        mask[row, list(needed_patches(sample.needed_boxes, max(image.size), image_size, patch_size))] = 1.0
    return mask


def tower_data(profile: PruningProfile, samples: Sequence[VQASample]) -> TowerData:
    image_ids: dict[str, int] = {}
    images: list[Image.Image] = []
    questions: dict[str, int] = {}
    for sample in samples:
        if sample.image_id not in image_ids:
            image_ids[sample.image_id] = len(images)
            images.append(sample.image)
        questions.setdefault(sample.question, len(questions))
    image_index = torch.tensor([image_ids[s.image_id] for s in samples])
    model = profile.model
    needed = needed_mask(samples, [images[i] for i in image_index.tolist()], model.image_size, model.patch_size)
    return TowerData(
        images, image_index, torch.tensor([questions[s.question] for s in samples]), needed, list(questions)
    )


@torch.no_grad()
def clip_rows(model: nn.Module, preprocess: ImagePreprocessor, images: Sequence[Image.Image], *, progress: bool = False) -> torch.Tensor:
    """K [I, N, Dv]: the model's vision feature rows (what QPriv-VL reads) of every image."""
    starts = range(0, len(images), ENCODE_BATCH)
    device = next(model.parameters()).device
    return torch.cat(
        [
            vision_features(model, preprocess(images[start : start + ENCODE_BATCH]).to(device)).float().cpu()
            for start in tqdm(starts, desc="towers: CLIP-V rows", unit="batch", disable=not progress)
        ]
    )


# --- the two objectives -----------------------------------------------------------------


def relevance_recall(logits: torch.Tensor, needed: torch.Tensor) -> dict[str, float]:
    """How many needed patches the top-k of `logits` [S, N] holds, k = each row's needed count
    (the question oracle's budget): `micro` (all hits / all needed) and `mean` (per question)."""
    counts = needed.sum(dim=1).long()
    hits = torch.zeros(len(counts))
    for row, k in enumerate(counts.tolist()):
        if k:
            hits[row] = needed[row, torch.topk(logits[row], k).indices].sum()
    valid = counts > 0
    return {
        "count": int(valid.sum()),
        "micro": float(hits[valid].sum() / counts[valid].sum()),
        "mean": float((hits[valid] / counts[valid]).mean()),
    }


class TextObjective:
    """BCE of the read-out's relevance logits against the needed-patch masks, plus `listwise`
    times the cross-entropy of each image's patch softmax averaged over its needed patches."""

    def __init__(
        self,
        data: TowerData,
        rows: torch.Tensor,
        tokenizer: PreTrainedTokenizerBase,
        text_model: CLIPTextModel,
        readout: RelevanceReadout,
        listwise: float = 0.0,
    ) -> None:
        self.data, self.rows, self.text_model, self.readout = data, rows, text_model, readout
        self.listwise = listwise
        self.input_ids, self.lengths = question_token_ids(
            tokenizer, data.questions, text_model.config.max_position_embeddings
        )

    def question_vectors(self, question_index: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(question_index, return_inverse=True)
        lengths = self.lengths[unique]
        vectors = pooled_question(self.text_model, self.input_ids[unique, : int(lengths.max())], lengths)
        return vectors[inverse]

    def logits(self, samples: torch.Tensor) -> torch.Tensor:
        question = self.question_vectors(self.data.question_index[samples])
        return self.readout(self.rows[self.data.image_index[samples]], question)

    def loss(self, samples: torch.Tensor) -> torch.Tensor:
        logits, needed = self.logits(samples), self.data.needed[samples]
        loss = F.binary_cross_entropy_with_logits(logits, needed)
        if self.listwise:
            listwise = -(F.log_softmax(logits, dim=1) * needed).sum(dim=1) / needed.sum(dim=1).clamp(min=1)
            loss = loss + self.listwise * listwise.mean()
        return loss

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        every = torch.arange(len(self.data.needed))
        logits = torch.cat([self.logits(batch) for batch in every.split(1024)])
        return {
            "bce": float(F.binary_cross_entropy_with_logits(logits, self.data.needed)),
            **relevance_recall(logits, self.data.needed),
        }


def patchify(pixel_values: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)·(W/p), C·p·p], patches row-major as the ViT's tokens."""
    batch, channels, height, width = pixel_values.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = pixel_values.reshape(batch, channels, grid_h, patch_size, grid_w, patch_size)
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(batch, grid_h * grid_w, channels * patch_size * patch_size)


class DinoObjective:
    """Per-patch content: each patch's (clean) pixels from its output row, the input noised."""

    def __init__(
        self, profile: PruningProfile, pixels: torch.Tensor, dino: Dinov2Model, noise: float, seed: int
    ) -> None:
        patch = profile.dino["patch_size"]
        self.grid_cells = profile.dino_grid**2
        self.pixels, self.dino, self.noise = pixels, dino, noise
        self.targets = patchify(pixels, patch)
        self.decoder = nn.Linear(profile.dino_hidden_size, self.targets.shape[-1])
        self.generator = torch.Generator().manual_seed(seed)

    def loss(self, images: torch.Tensor, *, noised: bool = True) -> torch.Tensor:
        pixels = self.pixels[images]
        if noised and self.noise > 0:
            pixels = pixels + self.noise * torch.randn(pixels.shape, generator=self.generator)
        rows = self.dino(pixel_values=pixels).last_hidden_state[:, -self.grid_cells :]
        return F.mse_loss(self.decoder(rows), self.targets[images])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        every = torch.arange(len(self.pixels))
        total = sum(float(self.loss(batch, noised=False)) * len(batch) for batch in every.split(256))
        return {"mse": total / len(every), "pixel_variance": float(self.targets.var())}


def _optimise(
    parameters: Sequence[nn.Parameter],
    count: int,
    loss: Any,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    desc: str,
    progress: bool,
) -> list[float]:
    """AdamW, cosine-annealed per step, over shuffled minibatches; per-epoch mean losses."""
    optimizer = torch.optim.AdamW(list(parameters), lr=lr)
    scheduler = CosineAnnealingLR(optimizer, T_max=max(1, epochs * math.ceil(count / batch_size)))
    generator = torch.Generator().manual_seed(seed)
    history = []
    bar = tqdm(range(epochs), desc=desc, unit="epoch", disable=not progress)
    for _ in bar:
        total = 0.0
        for batch in torch.randperm(count, generator=generator).split(batch_size):
            value = loss(batch)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            scheduler.step()
            total += float(value.detach()) * len(batch)
        history.append(total / count)
        bar.set_postfix(loss=f"{history[-1]:.4f}")
    return history


# --- build and load ---------------------------------------------------------------------


def _random_towers(profile: PruningProfile, tokenizer: PreTrainedTokenizerBase) -> tuple[CLIPTextModel, Dinov2Model, RelevanceReadout]:
    """The seeded starting point (the profile's random towers, and a read-out from the recipe's seed)."""
    random = build_random_encoders(profile, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(profile.towers.seed)
        readout = RelevanceReadout(profile)
    return random.text_model, random.dino, readout


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # Written whole, then renamed: an interrupted build never leaves a file that reads as finished.
    partial = path.with_name(f".{path.name}.partial")
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}, partial)
    os.replace(partial, path)


def _prefixed(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": tensor for name, tensor in module.state_dict().items()}


def _unprefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name[len(prefix) + 1 :]: tensor for name, tensor in tensors.items() if name.startswith(f"{prefix}.")}


def train_towers(
    profile: PruningProfile, source: TowerSource, *, root: Path | None = None, progress: bool = True
) -> Path:
    """Train (or finish training) the profile's towers against `source`; returns their folder."""
    if profile.towers is None:
        raise ValueError(f"pruning profile {profile.name!r} names no towers to train")
    recipe = profile.towers
    folder = towers_folder(profile, source, root)
    if _is_built(folder):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    report_path = folder / REPORT_FILE
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"stages": {}}
    report["key"] = towers_key(profile, source)
    report["source"] = source.description
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        samples = _training_samples(source)
        data = tower_data(profile, samples)
        text_model, dino, readout = _random_towers(profile, source.tokenizer)

        if not (folder / DINO_FILE).is_file():
            started = time.perf_counter()
            pixels = dino_image_preprocessor(profile.dino_image_size)(data.images)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(recipe.seed)
                objective = DinoObjective(profile, pixels, dino.train().requires_grad_(True), recipe.dino_noise, recipe.seed)
            before = objective.evaluate()
            history = _optimise(
                [*dino.parameters(), *objective.decoder.parameters()],
                len(pixels),
                objective.loss,
                epochs=recipe.dino_epochs,
                lr=recipe.dino_lr,
                batch_size=recipe.dino_batch_size,
                seed=recipe.seed,
                desc="towers: DINO stand-in (per-patch content)",
                progress=progress,
            )
            dino.eval()
            _save(dino.state_dict(), folder / DINO_FILE)
            report["stages"]["dino"] = {
                "seconds": round(time.perf_counter() - started, 1),
                "images": len(pixels),
                "before": before,
                "after": objective.evaluate(),
                "epoch_losses": history,
            }
            report_path.write_text(json.dumps(report, indent=2))

        if not (folder / TEXT_FILE).is_file():
            started = time.perf_counter()
            rows = clip_rows(source.model, source.preprocess_images, data.images, progress=progress)
            text_model.train().requires_grad_(True)
            readout.train().requires_grad_(True)
            objective = TextObjective(data, rows, source.tokenizer, text_model, readout, recipe.text_listwise)
            before = objective.evaluate()
            history = _optimise(
                [*text_model.parameters(), *readout.parameters()],
                len(samples),
                objective.loss,
                epochs=recipe.text_epochs,
                lr=recipe.text_lr,
                batch_size=recipe.text_batch_size,
                seed=recipe.seed,
                desc="towers: question tower + relevance read-out",
                progress=progress,
            )
            text_model.eval()
            readout.eval()
            after = objective.evaluate()
            _save({**_prefixed("text", text_model), **_prefixed("readout", readout)}, folder / TEXT_FILE)
            report["stages"]["text"] = {
                "seconds": round(time.perf_counter() - started, 1),
                "samples": len(samples),
                "questions": len(data.questions),
                "before": before,
                "after": after,
                "epoch_losses": history,
            }
            report_path.write_text(json.dumps(report, indent=2))
    finally:
        torch.set_num_threads(threads)
    return folder


def load_trained_encoders(
    profile: PruningProfile,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    source: TowerSource | None = None,
    build: bool = False,
    root: Path | None = None,
    progress: bool = False,
) -> FrozenEncoders:
    """The profile's trained towers as FrozenEncoders (with their relevance read-out).

    `source` defaults to the profile's mini build (mini_tower_source). Not built yet: trained
    now when `build`, else ModelNotAvailableError naming the command that builds them. A
    `tokenizer` other than the one the towers read is refused.
    """
    source = source or mini_tower_source(profile)
    if tokenizer is not None and tokenizer.get_vocab() != source.tokenizer.get_vocab():
        raise ValueError(
            f"the trained towers of pruning profile {profile.name!r} read the tokenizer of "
            f"{source.description or 'their source'}; this run's tokenizer has another vocabulary"
        )
    folder = towers_folder(profile, source, root)
    if not _is_built(folder):
        if not build:
            raise ModelNotAvailableError(
                f"the trained towers of pruning profile {profile.name!r} are not built in {folder}. Build them once "
                f"with `{TOWERS_COMMAND} --profile {profile.name}` (a few minutes on one CPU thread; {CACHE_ENV} "
                "sets where); `qpriv-prune prepare` also builds them on first use."
            )
        train_towers(profile, source, root=root, progress=progress)
    text_model, dino, readout = _random_towers(profile, source.tokenizer)
    text = load_file(folder / TEXT_FILE)
    text_model.load_state_dict(_unprefixed("text", text))
    readout.load_state_dict(_unprefixed("readout", text))
    dino.load_state_dict(load_file(folder / DINO_FILE))
    return FrozenEncoders(
        profile,
        text_model,
        source.tokenizer,
        dino,
        dino_image_preprocessor(profile.dino_image_size),
        relevance_readout=readout,
        vision_digest=vision_digest(source.model),
    )


def load_encoders(
    profile: PruningProfile,
    *,
    tokenizer: PreTrainedTokenizerBase,
    random_weights: bool,
    text_source: str | Path | None = None,
    dino_source: str | Path | None = None,
    build_towers: bool = False,
    tower_source: TowerSource | None = None,
    progress: bool = False,
) -> FrozenEncoders:
    """The encoders a run uses. `random_weights` (a random-weight model): seeded random ones.
    Otherwise: real ones where the profile names checkpoints (encoders.load_pretrained_encoders);
    for a profile that names `towers`, its trained towers (load_trained_encoders: trained on
    first use when `build_towers`, `tower_source` overriding the profile's build); seeded random
    ones for the other small profiles."""
    if random_weights:
        return build_random_encoders(profile, tokenizer)
    if profile.towers is not None:
        return load_trained_encoders(
            profile, tokenizer=tokenizer, source=tower_source, build=build_towers, progress=progress
        )
    if profile.text_hf_id is None or profile.dino_hf_id is None:
        return build_random_encoders(profile, tokenizer)
    return load_pretrained_encoders(profile, text_source=text_source, dino_source=dino_source)


def adopt_readout(module: QPrivVL, encoders: FrozenEncoders) -> bool:
    """Give `module` the encoders' pretrained relevance pair as its Wq/Wk (True), when they have
    one (trained towers); leave it as it is otherwise (False)."""
    readout = encoders.relevance_readout
    if readout is None:
        return False
    with torch.no_grad():
        module.query_projection.weight.copy_(readout.query_projection.weight)
        module.key_projection.weight.copy_(readout.key_projection.weight)
    return True
