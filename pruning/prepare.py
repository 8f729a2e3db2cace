"""Preparing DTP (SPEC §1): oracle grid search, privacy teacher, distilled student — one call.

`prepare_dtp(settings, out)` (and `qpriv-prune prepare`) runs four stages:

The answering model comes from the same loading rule as a run's (vlm.loading.load_weights):
the mini model's build, LLaVA-1.5-7B from a local folder (`model_source`) with the real CLIP
text tower and DINOv2 (`text_source`, `dino_source`), or seeded random weights reading the
word tokenizer over the preparation's samples (vlm.mini.tokenizer.build_sample_tokenizer, the
rule every run applies). Absent real weights fail before any data loads.

1. oracle: a fixed, randomly initialised scorer (seed `seed`) ranks each sample's patches
   (with encoders that carry a pretrained relevance read-out — a profile's trained towers,
   pruning.towers — its Wq/Wk are that read-out's unless `fixed_scorer` is "random": the
   pretrained pair is what makes a small profile's question relevance mean anything;
   `oracle_scorer` gives the search a scorer of its own, the teacher's mask keeping this one);
   for ρ in the grid, scanned in `direction` order ("smallest": small to large, the
   paper's text; "largest": large to small), the model answers with the top-k kept;
   ρ* is the first ρ whose answer still matches the gold answer (first-token substring
   match), 1.0 when none does. Searched on ≤ `oracle_samples` of each dataset's training
   samples (they label the teacher and the student) and on ≤ `eval_oracle_samples` of its
   evaluation split (held out: they only measure fit, and serve the oracle policy there).
2. sensitivity (teacher H_sens): multiple-instance learning on image-level bag labels;
   a bag's logit is the max of its patch logits (`bag_logits`), trained with BCE.
3. threshold (teacher MLPτ): H_sens frozen, MLPτ regresses ρ* (MSE) on the oracle samples.
4. student: a fresh module (random Wq/Wk, γ = 3) with H_sens and MLPτ copied from the
   teacher, every parameter trained on L_KD = λρ·Lρ + λm·Lm (`distillation_loss`) over
   all training samples with a cosine-annealed AdamW.

Each stage's result is cached in OUT/stages/<stage>-<key>.pt, where the key digests
every setting and input that decides it, chained through the stages it builds on: a
rerun skips finished stages, and a changed setting recomputes exactly the stages it
affects instead of reusing a result made for something else. OUT then holds oracle.pt
and dtp.pt (pruning.artifacts) for the oracle and dtp policies, and prepare.json, the
report. The artefacts record α and β, so DTP at α = 1 and α = 0 needs two folders.
"""

import hashlib
import inspect
import json
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from pruning.artifacts import oracle_key, save_dtp, save_oracle
from pruning.encoders import FrozenEncoders, encoder_checkpoints, update_with_weights
from pruning.inputs import PruningInputCache
from pruning.module import GAMMA_INIT, QPrivVL, build_qpriv_vl, keep_count, keep_indices
from pruning.profiles import PruningProfile, get_pruning_profile, pruning_profile_names
from pruning.towers import adopt_readout, load_encoders, needed_mask, relevance_recall, vision_digest
from vlm.answering import VisualTokenTransform, answer_questions
from vlm.features import VisionFeatureCache
from vlm.loading import (
    COMPUTE_DTYPES,
    RANDOM_STAGE,
    ModelBundle,
    ModelNotAvailableError,
    load_weights,
    locate_weights,
    uses_random_weights,
)
from vlm.mini import MiniRecipe
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import get_profile
from vqa import (
    PRIVATE,
    SHORT_ANSWER_INSTRUCTION,
    BagImage,
    VQASample,
    dataset_names,
    first_token_substring_match,
    get_adapter,
    is_stamped,
    load_privacy_bags,
    load_vqa,
    mark_patches,
    mark_records,
    privacy_bag_names,
)
from vqa.registry import select_rows

ORACLE_GRID = (0.10, 0.20, 0.30, 0.50, 0.70)
# "smallest" and "largest" keep the first matching ratio scanning from their end; "stable" keeps
# the largest ratio up to which every grid ratio matches: one lucky match on a yes/no or count
# question cannot carry a sample to the grid's top, as it does for "largest" when a short answer
# is guessed right from a few random tokens.
DIRECTIONS = ("smallest", "largest", "stable")
# The fixed scorer's Wq/Wk: "pretrained" takes the encoders' relevance read-out where they have
# one (trained towers) and stays random otherwise; "random" always stays random.
FIXED_SCORERS = ("pretrained", "random")
# ρ* of a sample no grid ratio kept correct: prune to the k_min floor.
NO_MATCH_RATIO = 1.0
# "vqa": the trained VQA model answers the oracle (mini's build, LLaVA-1.5's checkpoint);
# "random": seeded random weights (tests, timing).
MODEL_STAGES = ("vqa", RANDOM_STAGE)
TRAIN_SPLIT = "train"
BAG_TEST_SPLIT = "test"
REPORT_FILE = "prepare.json"
STAGES_FOLDER = "stages"
# Distinct seeds per random role, so the student's random Wq/Wk are not the oracle scorer's.
TEACHER_SEED_OFFSET, STUDENT_SEED_OFFSET = 1, 2
SCORING_BATCH = 256
# The oracle's two searches: training samples (labels) and evaluation-split samples (held out).
ORACLE_PARTS = ("train", "held_out")


class PrepareError(ValueError):
    """A preparation setting that is not allowed; the message names option, value and what is allowed."""

    def __init__(self, option: str, value: Any, allowed: str) -> None:
        self.option, self.value, self.allowed = option, value, allowed
        super().__init__(f"prepare option {option}={value!r} is not allowed; allowed: {allowed}")


@dataclass(frozen=True)
class PrepareSettings:
    """Every setting of one preparation; the defaults are the paper's (SPEC §1, "Preparing DTP").

    Counts are per dataset (`samples`, `oracle_samples`, `eval_oracle_samples`) or per
    bag set and split (`bag_samples`); each is a seeded random subset (`seed`) in source
    order, the same rows `load_vqa(..., limit, seed)` gives a simulation. `sources` maps a
    dataset or bag-set name to a local copy or hub id; `model_source`, `text_source` and
    `dino_source` are the real checkpoints (local folders or cached hub ids; empty: the
    profile's hub ids in the local HF cache) of profiles that have them. The answering
    model runs in `dtype` on `device`. `lr` is every stage's AdamW rate.
    """

    profile: str = "mini"
    datasets: tuple[str, ...] = ("easyvqa-stamped",)
    bags: tuple[str, ...] = ("easyvqa-stamped",)
    sources: Mapping[str, str] = field(default_factory=dict)
    model_stage: str = "vqa"
    model_source: str = ""
    text_source: str = ""
    dino_source: str = ""
    dtype: str = "fp32"
    device: str = "cpu"
    alpha: float = 1.0
    beta: float = 1.0
    seed: int = 0
    samples: int = 3000
    oracle_samples: int = 500
    eval_oracle_samples: int = 200
    bag_samples: int = 3000
    grid: tuple[float, ...] = ORACLE_GRID
    direction: str = "smallest"
    fixed_scorer: str = "pretrained"
    # The oracle search's own fixed scorer ("": fixed_scorer's). The paper's oracle ranks with a
    # random one; the teacher's mask, which the student's relevance distils, keeps fixed_scorer's.
    oracle_scorer: str = ""
    sensitivity_epochs: int = 10
    threshold_epochs: int = 20
    student_epochs: int = 20
    lr: float = 3e-4
    batch_size: int = 128
    lambda_ratio: float = 1.0
    lambda_mask: float = 1.0

    def __post_init__(self) -> None:
        for name in ("datasets", "bags", "grid"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "sources", dict(self.sources))
        self._validate()
        object.__setattr__(self, "grid", tuple(sorted(self.grid)))

    def _validate(self) -> None:
        def require(condition: bool, option: str, value: Any, allowed: str) -> None:
            if not condition:
                raise PrepareError(option, value, allowed)

        profiles = pruning_profile_names()
        require(self.profile in profiles, "--profile", self.profile, ", ".join(profiles))
        require(self.model_stage in MODEL_STAGES, "--model-stage", self.model_stage, ", ".join(MODEL_STAGES))
        trained = [name for name in profiles if not uses_random_weights(get_profile(name), "vqa")]
        require(
            self.profile in trained or self.model_stage == RANDOM_STAGE,
            "--profile",
            self.profile,
            f"{', '.join(trained)} with --model-stage vqa (any profile with --model-stage {RANDOM_STAGE})",
        )
        pruning_profile = get_pruning_profile(self.profile)
        for option, value, hub_id in (
            ("--model-source", self.model_source, pruning_profile.model.hf_id),
            ("--text-source", self.text_source, pruning_profile.text_hf_id),
            ("--dino-source", self.dino_source, pruning_profile.dino_hf_id),
        ):
            require(
                not value or (hub_id is not None and self.model_stage != RANDOM_STAGE),
                option,
                value,
                f"'' (profile {self.profile!r} at --model-stage {self.model_stage} has no real checkpoint to read)",
            )
        require(self.dtype in COMPUTE_DTYPES, "--dtype", self.dtype, ", ".join(COMPUTE_DTYPES))
        try:
            torch.device(self.device)
        except RuntimeError:
            require(False, "--device", self.device, "a torch device: cpu, cuda, cuda:1, …")
        for option, names, known in (
            ("--dataset", self.datasets, dataset_names()),
            ("--bags", self.bags, privacy_bag_names()),
        ):
            require(len(names) > 0, option, names, f"one or more of {', '.join(known)}")
            require(len(set(names)) == len(names), option, names, "each name once")
            for name in names:
                require(name in known, option, name, ", ".join(known))
        for name in self.datasets:
            splits = get_adapter(name).splits
            require(
                TRAIN_SPLIT in splits and len(splits) > 1,
                "--dataset",
                name,
                f"datasets with a {TRAIN_SPLIT!r} split and an evaluation split",
            )
        for name in self.sources:
            require(name in (*self.datasets, *self.bags), "--source", name, "a name given to --dataset or --bags")
        for option, value in (("--alpha", self.alpha), ("--beta", self.beta)):
            require(math.isfinite(value) and value >= 0, option, value, "a finite number >= 0")
        require(
            self.alpha > 0 or self.beta > 0, "--alpha", self.alpha, "> 0 when --beta is 0 (the score would be constant)"
        )
        require(self.seed >= 0, "--seed", self.seed, "an integer >= 0")
        for option, value in (
            ("--samples", self.samples),
            ("--bag-samples", self.bag_samples),
            ("--sensitivity-epochs", self.sensitivity_epochs),
            ("--threshold-epochs", self.threshold_epochs),
            ("--student-epochs", self.student_epochs),
            ("--batch-size", self.batch_size),
        ):
            require(value >= 1, option, value, "an integer >= 1")
        require(
            1 <= self.oracle_samples <= self.samples,
            "--oracle-samples",
            self.oracle_samples,
            f"1..--samples ({self.samples}): the oracle labels a subset of the training samples",
        )
        require(self.eval_oracle_samples >= 0, "--eval-oracle-samples", self.eval_oracle_samples, "an integer >= 0")
        require(len(self.grid) > 0, "--grid", self.grid, "one or more ratios")
        require(len(set(self.grid)) == len(self.grid), "--grid", self.grid, "each ratio once")
        for ratio in self.grid:
            require(0 < ratio < 1, "--grid", ratio, f"0 < ρ < 1 (ρ* = {NO_MATCH_RATIO} means no ratio matched)")
        require(self.direction in DIRECTIONS, "--direction", self.direction, ", ".join(DIRECTIONS))
        require(self.fixed_scorer in FIXED_SCORERS, "--fixed-scorer", self.fixed_scorer, ", ".join(FIXED_SCORERS))
        require(self.oracle_scorer in ("", *FIXED_SCORERS), "--oracle-scorer", self.oracle_scorer,
                ", ".join(FIXED_SCORERS) + ' or "" (the fixed scorer)')
        require(self.lr > 0, "--lr", self.lr, "a number > 0")
        for option, value in (("--lambda-ratio", self.lambda_ratio), ("--lambda-mask", self.lambda_mask)):
            require(math.isfinite(value) and value >= 0, option, value, "a finite number >= 0")
        require(
            self.lambda_ratio > 0 or self.lambda_mask > 0,
            "--lambda-ratio",
            self.lambda_ratio,
            "> 0 when --lambda-mask is 0 (the student would have no loss)",
        )


# --- the losses -------------------------------------------------------------------------


def bag_logits(patch_logits: torch.Tensor) -> torch.Tensor:
    """[B, Nd, 1] per-patch logits of H_sens -> [B] bag logits, by max pooling.

    MIL's assumption is that an image is private iff at least one of its patches is,
    which is a max. It also keeps each patch's σ(logit) a probability on the scale the
    rest of the module reads (fusion with u, the threshold head's max and fraction
    > 0.5): logsumexp would add up to log Nd to the bag logit, so a private image could
    be classified as such with no patch above 0.5, and a public one only with every
    patch pushed far below it.
    """
    return patch_logits.squeeze(-1).amax(dim=1)


def teacher_mask(relevance: torch.Tensor, sensitivity: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """The student's mask target σ(γ0·(α·u_fixed − β·s_teacher)), γ0 = 3.0 (γ's initial value).

    The paper only says Lm "distils the mask". The target pairs the relevance of the
    oracle's fixed scorer — the ranking under which the ρ* the student also fits were
    searched — with the privacy teacher's sensitivity, the knowledge of D_priv the student
    cannot otherwise see. `relevance` and `sensitivity` are [B, N] on the CLIP grid.
    """
    return torch.sigmoid(GAMMA_INIT * (alpha * relevance - beta * sensitivity))


def distillation_loss(
    ratio: torch.Tensor,
    soft_mask: torch.Tensor,
    teacher_ratio: torch.Tensor,
    oracle_ratio: torch.Tensor,
    has_oracle: torch.Tensor,
    mask_target: torch.Tensor,
    *,
    lambda_ratio: float,
    lambda_mask: float,
) -> dict[str, torch.Tensor]:
    """L_KD = λρ·Lρ + λm·Lm for a batch; every term a mean squared error.

    Lρ = MSE(ρ̂, teacher ρ̂) over the batch + MSE(ρ̂, ρ*) over its samples with an oracle
    ratio (`has_oracle`; none in the batch: 0). Lm = MSE(soft mask, `mask_target`).
    `ratio`, `teacher_ratio`, `oracle_ratio`, `has_oracle` are [B]; masks [B, N].
    """
    to_teacher = F.mse_loss(ratio, teacher_ratio)
    to_oracle = F.mse_loss(ratio[has_oracle], oracle_ratio[has_oracle]) if has_oracle.any() else ratio.new_zeros(())
    ratio_loss = to_teacher + to_oracle
    mask_loss = F.mse_loss(soft_mask, mask_target)
    return {
        "loss": lambda_ratio * ratio_loss + lambda_mask * mask_loss,
        "ratio": ratio_loss,
        "ratio_to_teacher": to_teacher,
        "ratio_to_oracle": to_oracle,
        "mask": mask_loss,
    }


def fit(
    parameters: Iterable[nn.Parameter],
    count: int,
    batch_loss: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    cosine: bool,
    desc: str,
    progress: bool,
) -> list[dict[str, float]]:
    """AdamW over shuffled minibatches of `count` items (`batch_loss(indices)["loss"]`
    is minimised); optionally cosine-annealed per step to 0. Returns per-epoch means."""
    optimizer = torch.optim.AdamW(list(parameters), lr=lr)
    scheduler = CosineAnnealingLR(optimizer, T_max=epochs * math.ceil(count / batch_size)) if cosine else None
    generator = torch.Generator().manual_seed(seed)
    history = []
    bar = tqdm(range(epochs), desc=desc, unit="epoch", disable=not progress)
    for _ in bar:
        sums: dict[str, float] = defaultdict(float)
        for indices in torch.randperm(count, generator=generator).split(batch_size):
            losses = batch_loss(indices)
            optimizer.zero_grad()
            losses["loss"].backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            for name, value in losses.items():
                sums[name] += float(value.detach()) * len(indices)
        history.append({name: total / count for name, total in sums.items()})
        bar.set_postfix(loss=f"{history[-1]['loss']:.4f}")
    return history


# --- the oracle -------------------------------------------------------------------------

Matcher = Callable[[float, Sequence[VQASample]], list[bool]]


def search_oracle(
    samples: Sequence[VQASample], grid: Sequence[float], direction: str, matches: Matcher
) -> dict[str, float]:
    """ρ* per sample (by `oracle_key`). "smallest" scans small to large and "largest" large to
    small, each keeping the first ratio whose pruned answer matches; "stable" scans small to
    large and keeps the last ratio before the first miss. A sample that no ratio keeps
    correct (for "stable": that misses at the smallest) gets NO_MATCH_RATIO. `matches(ρ, batch)`
    answers a batch pruned at ρ; a sample whose ratio is decided is never asked again."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}; allowed: {', '.join(DIRECTIONS)}")
    found: dict[str, float] = {}
    pending = list(samples)
    for ratio in sorted(grid, reverse=direction == "largest"):
        if not pending:
            break
        matched = matches(ratio, pending)
        hits = [sample for sample, hit in zip(pending, matched, strict=True) if hit]
        misses = [sample for sample, hit in zip(pending, matched, strict=True) if not hit]
        found.update({oracle_key(sample): ratio for sample in hits})
        pending = hits if direction == "stable" else misses
    return {oracle_key(sample): found.get(oracle_key(sample), NO_MATCH_RATIO) for sample in samples}


def ratio_histogram(ratios: Iterable[float]) -> dict[str, int]:
    counts = Counter(ratios)
    return {f"{ratio:.2f}": counts[ratio] for ratio in sorted(counts)}


# --- data, model and frozen inputs ------------------------------------------------------


@dataclass
class PreparationData:
    """`training`: ≤ `samples` per dataset (training split); `oracle`: a seeded subset of
    them; `held_out`: evaluation-split samples for the oracle only; bags by split."""

    training: list[VQASample]
    oracle: list[VQASample]
    held_out: list[VQASample]
    bags: dict[str, tuple[BagImage, ...]]


def load_preparation_data(settings: PrepareSettings) -> PreparationData:
    # Bags first: a bag selection holding one label is an option error, reported before the VQA data loads.
    bags = {
        split: tuple(
            image
            for name in settings.bags
            for image in load_privacy_bags(name, split, settings.sources.get(name), settings.bag_samples, settings.seed)
        )
        for split in (TRAIN_SPLIT, BAG_TEST_SPLIT)
    }
    if len({image.label for image in bags[TRAIN_SPLIT]}) < 2:
        raise PrepareError("--bags", settings.bags, "sets that together hold both private and public images")
    training: list[VQASample] = []
    oracle: list[VQASample] = []
    held_out: list[VQASample] = []
    for name in settings.datasets:
        source = settings.sources.get(name)
        train = load_vqa(name, TRAIN_SPLIT, source, limit=settings.samples, seed=settings.seed)
        training.extend(train)
        oracle.extend(train.select(select_rows(len(train), settings.oracle_samples, settings.seed, name, TRAIN_SPLIT)))
        if settings.eval_oracle_samples:
            # The evaluation split is each dataset's last (test, testdev or validation).
            evaluation = get_adapter(name).splits[-1]
            held_out.extend(load_vqa(name, evaluation, source, limit=settings.eval_oracle_samples, seed=settings.seed))
    return PreparationData(training, oracle, held_out, bags)


@dataclass
class FrozenInputs:
    """The answering model and every frozen per-sample input the stages read."""

    profile: PruningProfile
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    instruction: str | None
    model_fingerprint: str
    encoders: FrozenEncoders
    vision: VisionFeatureCache
    pruning: PruningInputCache
    bag_patches: dict[str, torch.Tensor]
    bag_labels: dict[str, torch.Tensor]

    def batch(self, samples: Sequence[VQASample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CLIP patches [B, N, Dv], question vectors [B, Dt], DINOv2 patches [B, Nd, Dd]."""
        return self.vision.stack(samples), self.pruning.question_vectors(samples), self.pruning.dino_patches(samples)


def check_weights(settings: PrepareSettings) -> None:
    """Fail in milliseconds, before any data loads, when a real checkpoint the preparation reads is absent."""
    profile = get_pruning_profile(settings.profile)
    try:
        locate_weights(profile.model, stage=settings.model_stage, source=settings.model_source or None)
        if not _random_encoders(settings) and profile.towers is None:
            encoder_checkpoints(
                profile, text_source=settings.text_source or None, dino_source=settings.dino_source or None
            )
    except ModelNotAvailableError as error:
        raise ModelNotAvailableError(
            f"{error} With qpriv-prune prepare: --model-source DIR (LLaVA), --text-source DIR (CLIP), "
            "--dino-source DIR (DINOv2)."
        ) from error


def prepared_policy_settings(folder: Path) -> dict[str, Any]:
    """The PolicyContext settings that read a prepared folder as it was made (its prepare.json):
    the fusion weights, the seed, the folder, and the encoders it was prepared with."""
    settings = json.loads((folder / "prepare.json").read_text())["settings"]
    prepared = PrepareSettings(**{key: value for key, value in settings.items()
                                  if key in inspect.signature(PrepareSettings).parameters})
    return {"alpha": settings["alpha"], "beta": settings["beta"], "seed": settings.get("seed", 0), "artifacts": folder,
            "random_encoders": _random_encoders(prepared), "text_source": settings.get("text_source") or None,
            "dino_source": settings.get("dino_source") or None}


def _random_encoders(settings: PrepareSettings) -> bool:
    """Random encoders go with a random-weight model, and with profiles that name neither real
    encoders nor trained towers (pruning.towers)."""
    profile = get_pruning_profile(settings.profile)
    if uses_random_weights(profile.model, settings.model_stage):
        return True
    return profile.towers is None and None in (profile.text_hf_id, profile.dino_hf_id)


def load_answering_model(settings: PrepareSettings, samples: Sequence[VQASample]) -> ModelBundle:
    """The model the oracle asks, with a tokenizer: loaded as a run loads it (vlm.loading.load_weights);
    random weights read the word tokenizer over `samples` (its size is their vocabulary)."""
    profile = get_pruning_profile(settings.profile).model
    tokenizer = None
    token_ids = None
    if uses_random_weights(profile, settings.model_stage):
        tokenizer = build_sample_tokenizer(samples)
        token_ids = dict(
            vocab_size=len(tokenizer),
            image_token_id=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
            pad_token_id=tokenizer.pad_token_id,
        )
    bundle = load_weights(
        profile,
        stage=settings.model_stage,
        source=settings.model_source or None,
        dtype=COMPUTE_DTYPES[settings.dtype],
        device=settings.device,
        seed=settings.seed,
        random_token_ids=token_ids,
    )
    return replace(bundle, tokenizer=bundle.tokenizer or tokenizer)


@torch.no_grad()
def encode_bags(encoders: FrozenEncoders, bags: Sequence[BagImage], *, desc: str, progress: bool) -> torch.Tensor:
    """DINOv2 patches [n, Nd, Dd] of every bag image."""
    batches = range(0, len(bags), SCORING_BATCH)
    return torch.cat(
        [
            encoders.encode_images([bag.image for bag in bags[start : start + SCORING_BATCH]]).cpu()
            for start in tqdm(batches, desc=desc, unit="batch", disable=not progress)
        ]
    )


def load_frozen_inputs(settings: PrepareSettings, data: PreparationData, *, progress: bool) -> FrozenInputs:
    profile = get_pruning_profile(settings.profile)
    samples = [*data.training, *data.held_out]
    bundle = load_answering_model(settings, samples)
    model, tokenizer = bundle.model, bundle.tokenizer
    digest = hashlib.sha256()
    update_with_weights(digest, model)
    encoders = load_encoders(
        profile,
        tokenizer=tokenizer,
        random_weights=_random_encoders(settings),
        text_source=settings.text_source or None,
        dino_source=settings.dino_source or None,
        build_towers=True,
        progress=progress,
    ).to(settings.device)
    if encoders.vision_digest is not None and encoders.vision_digest != vision_digest(model):
        raise ValueError(
            f"the trained towers of pruning profile {profile.name!r} were aligned to another vision tower "
            f"({encoders.vision_digest}) than the answering model's ({vision_digest(model)}); rebuild the model "
            "or the towers so that they match"
        )
    vision = VisionFeatureCache(model, bundle.preprocess_images)
    vision.add(samples, progress=progress)
    pruning = PruningInputCache(encoders)
    pruning.add(samples, progress=progress)
    bag_patches = {
        split: encode_bags(encoders, bags, desc=f"bag DINOv2 patches ({split})", progress=progress)
        for split, bags in data.bags.items()
    }
    bag_labels = {
        split: torch.tensor([bag.label for bag in bags], dtype=torch.float32) for split, bags in data.bags.items()
    }
    return FrozenInputs(
        profile=profile,
        model=model,
        tokenizer=tokenizer,
        # The run's prompt (training.model.PartyModel.instruction): LLaVA-1.5's short-answer line
        # for its real checkpoint; the offline profiles are trained without it (the mini recipe's).
        instruction=SHORT_ANSWER_INSTRUCTION if profile.model.hf_id else MiniRecipe().instruction,
        model_fingerprint=digest.hexdigest()[:16],
        encoders=encoders,
        vision=vision,
        pruning=pruning,
        bag_patches=bag_patches,
        bag_labels=bag_labels,
    )


def samples_digest(samples: Iterable[VQASample]) -> str:
    """What a stage saw of the data: every sample's key, question and gold answers."""
    rows = [[oracle_key(s), s.question, s.answer, list(s.answers)] for s in samples]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def bags_digest(bags: Mapping[str, Sequence[BagImage]]) -> str:
    rows = {split: [[bag.id, bag.label] for bag in images] for split, images in bags.items()}
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def in_batches(samples: Sequence[VQASample], compute: Callable[[Sequence[VQASample]], torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [compute(samples[start : start + SCORING_BATCH]) for start in range(0, len(samples), SCORING_BATCH)]
    )


# --- the stages -------------------------------------------------------------------------


@dataclass
class StageResult:
    key: str
    record: dict[str, Any]
    cached: bool


class StageCache:
    """Stage results in OUT/stages/<stage>-<key>.pt; the key digests the stage's settings."""

    def __init__(self, out: Path) -> None:
        self.folder = out / STAGES_FOLDER

    def run(self, stage: str, settings: Mapping[str, Any], compute: Callable[[], dict[str, Any]]) -> StageResult:
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
        path = self.folder / f"{stage}-{key}.pt"
        if path.is_file():
            return StageResult(key, torch.load(path, weights_only=True), cached=True)
        started = time.perf_counter()
        record = {**compute(), "settings": dict(settings)}
        record["seconds"] = round(time.perf_counter() - started, 2)
        self.folder.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: an interrupted run never leaves a file that reads as finished.
        partial = path.with_suffix(".partial")
        torch.save(record, partial)
        os.replace(partial, path)
        return StageResult(key, record, cached=False)


def run_oracle(
    settings: PrepareSettings, data: PreparationData, frozen: FrozenInputs, scorer: QPrivVL, progress: bool
) -> dict[str, Any]:
    """ρ* of the oracle's training and held-out samples (`search_oracle` with the model's answers)."""

    def answers_match(samples: Sequence[VQASample], visual_tokens: VisualTokenTransform | None) -> list[bool]:
        answers = answer_questions(
            frozen.model,
            frozen.tokenizer,
            frozen.vision,
            samples,
            instruction=frozen.instruction,
            visual_tokens=visual_tokens,
            progress=False,
        )
        return [
            first_token_substring_match(answer, sample.answers or sample.answer)
            for answer, sample in zip(answers, samples, strict=True)
        ]

    def matches(bar: tqdm, ratio: float, samples: Sequence[VQASample]) -> list[bool]:
        score = in_batches(samples, lambda batch: scorer(*frozen.batch(batch)).score)
        kept = keep_indices(score, [ratio] * len(samples), frozen.profile.k_min)
        keep = {oracle_key(sample): indices for sample, indices in zip(samples, kept, strict=True)}
        hits = answers_match(samples, lambda sample, tokens: tokens[keep[oracle_key(sample)]])
        bar.update()
        bar.set_postfix(ratio=ratio, matched=sum(hits), pending=len(samples) - sum(hits))
        return hits

    results: dict[str, Any] = {}
    for part, samples in zip(ORACLE_PARTS, (data.oracle, data.held_out), strict=True):
        with tqdm(total=len(settings.grid), desc=f"oracle ({part})", unit="ratio", disable=not progress) as bar:
            ratios = search_oracle(samples, settings.grid, settings.direction, partial(matches, bar))
        # Context for the histogram: how often the model is right with every patch kept.
        unpruned = answers_match(samples, None)
        results[part] = {
            "ratios": ratios,
            "histogram": ratio_histogram(ratios.values()),
            "unpruned_match_rate": sum(unpruned) / len(unpruned) if unpruned else None,
        }
    return results


def run_sensitivity(
    settings: PrepareSettings, frozen: FrozenInputs, teacher: QPrivVL, progress: bool
) -> dict[str, Any]:
    patches, labels = frozen.bag_patches[TRAIN_SPLIT], frozen.bag_labels[TRAIN_SPLIT]

    def batch_loss(indices: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = bag_logits(teacher.sensitivity_head(patches[indices]))
        return {"loss": F.binary_cross_entropy_with_logits(logits, labels[indices])}

    history = fit(
        teacher.sensitivity_head.parameters(),
        len(labels),
        batch_loss,
        epochs=settings.sensitivity_epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=settings.seed,
        cosine=False,
        desc="teacher H_sens (MIL)",
        progress=progress,
    )
    return {"state": teacher.sensitivity_head.state_dict(), "epoch_losses": history}


def bag_accuracy(teacher: QPrivVL, frozen: FrozenInputs, bags: Sequence[BagImage], split: str) -> dict[str, Any]:
    """Bag accuracy (σ(max patch logit) > 0.5 is "private") overall, per set and per label."""
    with torch.no_grad():
        predicted = (bag_logits(teacher.sensitivity_head(frozen.bag_patches[split])) > 0).long().tolist()
    groups: dict[str, list[bool]] = defaultdict(list)
    for bag, guess in zip(bags, predicted, strict=True):
        correct = guess == bag.label
        groups["overall"].append(correct)
        groups[f"set/{bag.dataset}"].append(correct)
        groups["private" if bag.label == PRIVATE else "public"].append(correct)
    return {name: {"accuracy": sum(hits) / len(hits), "count": len(hits)} for name, hits in groups.items()}


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """The area under the ROC curve of `scores` for boolean `labels` (Mann-Whitney, ties
    counted half); None when either class is empty."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if not positives or not negatives:
        return None
    ordered, order = scores.sort()
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = torch.empty_like(scores)
    ranks[order] = ((ends - counts + 1 + ends) / 2)[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def mark_ranking(teacher: QPrivVL, frozen: FrozenInputs, bags: Sequence[BagImage], split: str) -> dict[str, Any]:
    """Where bag images come from a stamped dataset (their marks recorded): how well H_sens
    ranks the patches that hold a mark above every other patch of those images, as the AUROC
    of its DINO-grid map (the labels it never saw, only its bag labels); {} otherwise."""
    stamped = {name for name in {bag.dataset for bag in bags} if name in dataset_names() and is_stamped(name)}
    rows = [row for row, bag in enumerate(bags) if bag.dataset in stamped]
    if not rows:
        return {}
    marks = {image_id: mark for name in sorted(stamped) for image_id, mark in mark_records(name, split).items()}
    profile = frozen.profile
    with torch.no_grad():
        sensitivity = teacher.patch_sensitivity(frozen.bag_patches[split][rows])
    labels = torch.zeros_like(sensitivity, dtype=torch.bool)
    for index, row in enumerate(rows):
        mark = marks.get(bags[row].id)
        if mark is not None:
            labels[index, list(mark_patches(mark, profile.dino_image_size, profile.dino["patch_size"]))] = True
    return {
        "mark_auroc": {
            "auroc": auroc(sensitivity, labels),
            "images": len(rows),
            "patches": labels.numel(),
            "mark_patches": int(labels.sum()),
        }
    }


def ratio_fit(
    predicted: torch.Tensor, target: torch.Tensor, num_patches: int, k_min: int, constant: float
) -> dict[str, Any]:
    """How well predicted ratios fit targets: MAE, Pearson r (None when either side is
    constant), means, mean kept tokens, and the MAE of predicting `constant` (the
    training mean) for comparison."""
    if not len(target):
        return {"count": 0}
    predicted, target = predicted.double(), target.double()
    centred_p, centred_t = predicted - predicted.mean(), target - target.mean()
    norm = float(centred_p.norm() * centred_t.norm())
    return {
        "count": len(target),
        "mae": float((predicted - target).abs().mean()),
        "pearson": float((centred_p * centred_t).sum()) / norm if norm > 0 else None,
        "mean_predicted": float(predicted.mean()),
        "mean_target": float(target.mean()),
        "constant_mae": float((target - constant).abs().mean()),
        "mean_kept_tokens_predicted": sum(keep_count(float(r), num_patches, k_min) for r in predicted) / len(target),
        "mean_kept_tokens_target": sum(keep_count(float(r), num_patches, k_min) for r in target) / len(target),
    }


def oracle_targets(samples: Sequence[VQASample], ratios: Mapping[str, float]) -> torch.Tensor:
    return torch.tensor([ratios[oracle_key(sample)] for sample in samples])


def predicted_ratios(module: QPrivVL, frozen: FrozenInputs, samples: Sequence[VQASample]) -> torch.Tensor:
    def predict(batch: Sequence[VQASample]) -> torch.Tensor:
        vision, question, dino = frozen.batch(batch)
        return module.predict_ratio(module.threshold_input(vision, question, module.patch_sensitivity(dino)))

    return in_batches(samples, predict) if samples else torch.zeros(0)


def fits(module: QPrivVL, frozen: FrozenInputs, data: PreparationData, oracle: Mapping[str, Any]) -> dict[str, Any]:
    """`module`'s ρ̂ against ρ* on the oracle's training samples and on the held-out ones."""
    train_target = oracle_targets(data.oracle, oracle["train"]["ratios"])
    constant = float(train_target.mean())
    return {
        part: ratio_fit(
            predicted_ratios(module, frozen, samples),
            oracle_targets(samples, oracle[part]["ratios"]),
            frozen.profile.num_patches,
            frozen.profile.k_min,
            constant,
        )
        for part, samples in zip(ORACLE_PARTS, (data.oracle, data.held_out), strict=True)
    }


def run_threshold(
    settings: PrepareSettings,
    data: PreparationData,
    frozen: FrozenInputs,
    teacher: QPrivVL,
    oracle: Mapping[str, Any],
    progress: bool,
) -> dict[str, Any]:
    # H_sens stays as the MIL stage left it: its outputs are computed once, without gradients.
    def threshold_inputs(batch: Sequence[VQASample]) -> torch.Tensor:
        vision, question, dino = frozen.batch(batch)
        return teacher.threshold_input(vision, question, teacher.patch_sensitivity(dino))

    inputs = in_batches(data.oracle, threshold_inputs)
    targets = oracle_targets(data.oracle, oracle["train"]["ratios"])

    def batch_loss(indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(teacher.predict_ratio(inputs[indices]), targets[indices])}

    history = fit(
        teacher.threshold_head.parameters(),
        len(targets),
        batch_loss,
        epochs=settings.threshold_epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=settings.seed,
        cosine=False,
        desc="teacher MLPτ",
        progress=progress,
    )
    return {"state": teacher.threshold_head.state_dict(), "epoch_losses": history}


def run_student(
    settings: PrepareSettings,
    data: PreparationData,
    frozen: FrozenInputs,
    scorer: QPrivVL,
    teacher: QPrivVL,
    oracle: Mapping[str, Any],
    progress: bool,
) -> dict[str, Any]:
    samples = data.training

    def targets(batch: Sequence[VQASample]) -> torch.Tensor:
        vision, question, dino = frozen.batch(batch)
        sensitivity = teacher.align(teacher.patch_sensitivity(dino))
        mask = teacher_mask(scorer.relevance(vision, question), sensitivity, settings.alpha, settings.beta)
        ratio = teacher.predict_ratio(teacher.threshold_input(vision, question, teacher.patch_sensitivity(dino)))
        return torch.cat([ratio[:, None], mask], dim=1)

    teacher_targets = in_batches(samples, targets)
    teacher_ratio, mask_target = teacher_targets[:, 0], teacher_targets[:, 1:]
    labelled = oracle["train"]["ratios"]
    has_oracle = torch.tensor([oracle_key(sample) in labelled for sample in samples])
    oracle_ratio = torch.tensor([labelled.get(oracle_key(sample), 0.0) for sample in samples])

    student = build_qpriv_vl(
        frozen.profile, seed=settings.seed + STUDENT_SEED_OFFSET, alpha=settings.alpha, beta=settings.beta
    )
    student.sensitivity_head.load_state_dict(teacher.sensitivity_head.state_dict())
    student.threshold_head.load_state_dict(teacher.threshold_head.state_dict())

    def batch_loss(indices: torch.Tensor) -> dict[str, torch.Tensor]:
        output = student(*frozen.batch([samples[i] for i in indices.tolist()]))
        return distillation_loss(
            output.ratio,
            output.soft_mask,
            teacher_ratio[indices],
            oracle_ratio[indices],
            has_oracle[indices],
            mask_target[indices],
            lambda_ratio=settings.lambda_ratio,
            lambda_mask=settings.lambda_mask,
        )

    history = fit(
        student.parameters(),
        len(samples),
        batch_loss,
        epochs=settings.student_epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=settings.seed,
        cosine=True,
        desc="student (L_KD)",
        progress=progress,
    )
    to_teacher = ratio_fit(
        predicted_ratios(student, frozen, samples),
        teacher_ratio,
        frozen.profile.num_patches,
        frozen.profile.k_min,
        float(teacher_ratio.mean()),
    )
    return {
        "state": student.state_dict(),
        "epoch_losses": history,
        "fit_to_teacher": to_teacher,
        "gamma": student.gamma.item(),
    }


# --- the command ------------------------------------------------------------------------


def prepare_dtp(settings: PrepareSettings, out: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the preparation into `out`; returns the report also written to out/prepare.json."""
    out = Path(out)
    started = time.perf_counter()
    check_weights(settings)
    data = load_preparation_data(settings)
    frozen = load_frozen_inputs(settings, data, progress=progress)
    inputs_seconds = round(time.perf_counter() - started, 2)
    profile, cache = frozen.profile, StageCache(out)
    identity = {"profile": profile.name, "model": frozen.model_fingerprint, "encoders": frozen.encoders.fingerprint}

    scorer = build_qpriv_vl(profile, seed=settings.seed, alpha=settings.alpha, beta=settings.beta).eval()
    pretrained_scorer = settings.fixed_scorer == "pretrained" and adopt_readout(scorer, frozen.encoders)
    oracle_scorer, pretrained_oracle = scorer, pretrained_scorer
    if settings.oracle_scorer not in ("", settings.fixed_scorer):
        oracle_scorer = build_qpriv_vl(profile, seed=settings.seed, alpha=settings.alpha, beta=settings.beta).eval()
        pretrained_oracle = settings.oracle_scorer == "pretrained" and adopt_readout(oracle_scorer, frozen.encoders)
    oracle = cache.run(
        "oracle",
        {
            **identity,
            "oracle_samples": samples_digest(data.oracle),
            "held_out_samples": samples_digest(data.held_out),
            "grid": settings.grid,
            "direction": settings.direction,
            "scorer_seed": settings.seed,
            "alpha": settings.alpha,
            "beta": settings.beta,
            # Only where it applies, so that every earlier preparation keeps its key.
            **({"scorer_projections": "pretrained read-out"} if pretrained_oracle else {}),
        },
        lambda: run_oracle(settings, data, frozen, oracle_scorer, progress),
    )
    training = {"lr": settings.lr, "batch_size": settings.batch_size, "seed": settings.seed}
    teacher = build_qpriv_vl(
        profile, seed=settings.seed + TEACHER_SEED_OFFSET, alpha=settings.alpha, beta=settings.beta
    )
    sensitivity = cache.run(
        "sensitivity",
        {
            "profile": profile.name,
            "encoders": frozen.encoders.fingerprint,
            "bags": bags_digest(data.bags),
            "epochs": settings.sensitivity_epochs,
            **training,
        },
        lambda: run_sensitivity(settings, frozen, teacher, progress),
    )
    teacher.sensitivity_head.load_state_dict(sensitivity.record["state"])
    threshold = cache.run(
        "threshold",
        {"sensitivity": sensitivity.key, "oracle": oracle.key, "epochs": settings.threshold_epochs, **training},
        lambda: run_threshold(settings, data, frozen, teacher, oracle.record, progress),
    )
    teacher.threshold_head.load_state_dict(threshold.record["state"])
    student = cache.run(
        "student",
        {
            "threshold": threshold.key,
            "training_samples": samples_digest(data.training),
            "epochs": settings.student_epochs,
            "lambda_ratio": settings.lambda_ratio,
            "lambda_mask": settings.lambda_mask,
            "mask_target": "sigmoid(3 * (alpha * u_fixed_scorer - beta * s_teacher))",
            **training,
        },
        lambda: run_student(settings, data, frozen, scorer, teacher, oracle.record, progress),
    )
    dtp = build_qpriv_vl(profile, seed=settings.seed + STUDENT_SEED_OFFSET, alpha=settings.alpha, beta=settings.beta)
    dtp.load_state_dict(student.record["state"])
    dtp.eval()

    all_ratios = {key: ratio for part in ORACLE_PARTS for key, ratio in oracle.record[part]["ratios"].items()}
    save_oracle(out, all_ratios, oracle_scorer, frozen.encoders)
    save_dtp(out, dtp, frozen.encoders)
    oracle_metrics = {part: {k: v for k, v in oracle.record[part].items() if k != "ratios"} for part in ORACLE_PARTS}
    report = {
        "settings": asdict(settings),
        "out": str(out.resolve()),
        "environment": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0],
        },
        "data": {
            "training_samples": len(data.training),
            "oracle_samples": len(data.oracle),
            "held_out_oracle_samples": len(data.held_out),
            "bags": {
                split: Counter("private" if bag.label == PRIVATE else "public" for bag in bags)
                for split, bags in data.bags.items()
            },
        },
        "inputs_seconds": inputs_seconds,
        "stages": {
            "oracle": _stage_report(oracle, oracle_metrics),
            "sensitivity": _stage_report(
                sensitivity,
                {
                    "bag_accuracy": bag_accuracy(teacher, frozen, data.bags[BAG_TEST_SPLIT], BAG_TEST_SPLIT),
                    **mark_ranking(teacher, frozen, data.bags[BAG_TEST_SPLIT], BAG_TEST_SPLIT),
                },
            ),
            "threshold": _stage_report(threshold, {"fit_to_oracle": fits(teacher, frozen, data, oracle.record)}),
            "student": _stage_report(
                student,
                {
                    "fit_to_oracle": fits(dtp, frozen, data, oracle.record),
                    "fit_to_teacher": student.record["fit_to_teacher"],
                    "gamma": student.record["gamma"],
                    **relevance_report({"fixed_scorer": scorer, "student": dtp}, frozen, data),
                },
            ),
        },
        "fixed_scorer": "pretrained read-out" if pretrained_scorer else "random",
        "oracle_scorer": "pretrained read-out" if pretrained_oracle else "random",
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def relevance_report(
    modules: Mapping[str, QPrivVL], frozen: FrozenInputs, data: PreparationData
) -> dict[str, Any]:
    """Where the data knows what each question needs (`needed_boxes`): how many needed patches
    each module's relevance u puts in its top k at the question oracle's budget (k = the
    needed count; pruning.towers.relevance_recall), on the training and held-out samples."""
    report: dict[str, Any] = {}
    for part, samples in (("training", data.training), ("held_out", data.held_out)):
        samples = [sample for sample in samples if sample.needed_boxes]
        if not samples:
            continue
        model = frozen.profile.model
        needed = needed_mask(samples, [sample.image for sample in samples], model.image_size, model.patch_size)
        for name, module in modules.items():
            relevance = in_batches(samples, lambda batch, module=module: module.relevance(*frozen.batch(batch)[:2]))
            report.setdefault("relevance_recall", {}).setdefault(name, {})[part] = relevance_recall(relevance, needed)
    return report


def _stage_report(stage: StageResult, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's key, whether it was cached, the seconds it took when it ran, its losses and metrics."""
    losses = stage.record.get("epoch_losses")
    return {
        "key": stage.key,
        "cached": stage.cached,
        "seconds": stage.record["seconds"],
        **({"epoch_losses": losses} if losses is not None else {}),
        **metrics,
    }
