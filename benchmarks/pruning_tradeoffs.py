"""What each pruning policy costs and buys on the mini model (issue 4, "Results, by a script").

    python benchmarks/pruning_tradeoffs.py [--questions N] [--seed S] [--threads T] [--cache DIR]
    python benchmarks/pruning_tradeoffs.py --report

The finished mini model (VQA stage) answers a seeded subset of the stamped benchmark's
test split (`easyvqa-stamped`) with each policy applied at inference only: the model
was fine-tuned on every visual token and is not re-fine-tuned under pruning. Policies:
off, fixed ρ = 0.3/0.5/0.7/0.9 (ranked by the trained α = 1 module, so they differ from
DTP only in how many tokens they keep), DTP at α = 1 and α = 0, and a fixed ratio at
each DTP's own mean budget ranked by the same module (the like-for-like comparison).
Per policy:

- test accuracy vs kept tokens (mean and distribution);
- sensitivity exclusion ratio against one reference map for every policy (the trained
  H_sens of the α = 1 artefact) and against the policy's own map where it has one;
- on stamped test images, the share of mark patches removed vs of all patches removed;
- exact serialised bytes of one sample's USL activation at the first cut, through the
  real wire encoder under the fp32 and bf16 policies;
- "what survives": a logistic-regression probe reading the stamped digit from the kept
  vision tokens only, vs chance, no pruning and an ideal pruner that removes exactly
  the mark patches.

Also DTP's forward cost as a share of the vision tower's (FLOPs at mini and llava-1.5-7b
size, wall time at mini), and the paper's two claims checked. The DTP artefacts are
prepared into the cache folder on first use (`prepare_dtp`, about a minute each) and
reused after. Writes results/pruning_tradeoffs.json and .png, and results/pruning_tradeoffs.md
from the JSON (printed too); --report only re-renders the markdown.
"""

import argparse
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from flwr.app import RecordDict
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm
from transformers import CLIPTextModel, Dinov2Model

from analysis.claims.qpriv_vl import MATCH_POINTS, PAPER_EXCLUSION_RATIO
from analysis.stats import ABOVE, MIN_SEEDS, Outcomes, Rule, Verdict, compare
from pruning import (
    DTP_FILE,
    ORACLE_FILE,
    PolicyContext,
    VisualTokenSelector,
    build_policy,
    get_policy,
    policy_options,
    sensitivity_exclusion_ratios,
    summarize_exclusion,
    summarize_keep_counts,
)
from pruning.encoders import FrozenEncoders, clip_text_config, dino_config
from pruning.module import QPrivVL
from pruning.prepare import PrepareSettings, prepare_dtp
from pruning.profiles import get_pruning_profile
from training import protocol
from training.batches import encode_samples
from vlm.answering import answer_questions
from vlm.features import VisionFeatureCache
from vlm.loading import ModelBundle, ModelNotAvailableError, build_model_on_meta
from vlm.mini import MiniRecipe, load_mini
from vlm.mini.build import BUILD_COMMAND, cache_root
from vlm.segments import (
    merge_multimodal_inputs,
    project_visual_features,
    run_decoder_layers,
    vision_features,
)
from vqa import (
    MarkRecord,
    VQASample,
    load_vqa,
    mark_patches,
    mark_records,
    score_sample,
)
from wire import Wire, pack_rows, serialized_size

from report import (
    REPORT_HELP,
    RESULTS,
    add_allow_dirty,
    markdown_table,
    percent,
    provenance_for,
    read_json,
    span,
    write_json,
    write_markdown,
)

NAME = "pruning_tradeoffs"
COMMAND = "python benchmarks/pruning_tradeoffs.py"
DATASET = "easyvqa-stamped"
PROFILE = "mini"
PAPER_PROFILE = "llava-1.5-7b"
FIXED_RATIOS = (0.3, 0.5, 0.7, 0.9)
DTP_ALPHAS = (1.0, 0.0)
# The reference sensitivity map every policy is measured against: the α = 1 artefact's H_sens.
REFERENCE_ALPHA = 1.0
WIRE_POLICIES = ("fp32", "bf16")
BATCH = 256
# Wall-time comparison: one batch of test images, timed interleaved so load changes hit every part alike.
TIMING_BATCH = 64
# CLIP's BPE vocabulary (openai/clip-vit-large-patch14-336): only the embedding's size, no FLOPs.
CLIP_VOCAB, CLIP_BOS, CLIP_EOS = 49408, 49406, 49407


@dataclass(frozen=True)
class PolicyChoice:
    """One row of the comparison. `alpha` picks the artefact folder whose module ranks
    the patches (and, for DTP, predicts ρ̂); off ranks nothing."""

    label: str
    policy: str
    ratio: float = 0.0
    alpha: float = REFERENCE_ALPHA


def dtp_label(alpha: float) -> str:
    return f"DTP α={alpha:g}"


def matched_label(alpha: float) -> str:
    return f"fixed @ DTP α={alpha:g} budget"


def artefact_folder(cache: Path, alpha: float) -> Path:
    return cache / f"dtp-alpha{alpha:g}"


def prepared_artefacts(cache: Path, alpha: float) -> tuple[Path, dict[str, Any] | None]:
    """The artefact folder for α (β = 1, the paper's defaults), prepared if it lacks a file."""
    folder = artefact_folder(cache, alpha)
    if not ((folder / DTP_FILE).is_file() and (folder / ORACLE_FILE).is_file()):
        print(f"preparing DTP (α={alpha:g}) into {folder}")
        prepare_dtp(PrepareSettings(profile=PROFILE, alpha=alpha), folder)
    report = folder / "prepare.json"
    return folder, json.loads(report.read_text()) if report.is_file() else None


# --- data -----------------------------------------------------------------------------------


@dataclass
class Benchmark:
    """The model, the evaluated questions, the probe's images and the cached features."""

    bundle: ModelBundle
    instruction: str | None
    features: VisionFeatureCache
    test: Sequence[VQASample]
    probe_train: list[VQASample]
    probe_test: list[VQASample]
    # Both splits' marks by image id (the ids name the split, so they never collide).
    marks: dict[str, MarkRecord]

    @property
    def num_patches(self) -> int:
        return self.bundle.profile.num_patches

    def mark_patches_of(self, sample: VQASample) -> tuple[int, ...]:
        """The patches holding the sample's mark on the mini grid; () for a plain image."""
        mark = self.marks.get(sample.image_id)
        profile = self.bundle.profile
        return () if mark is None else mark_patches(mark, profile.image_size, profile.patch_size)

    def digits(self, samples: Sequence[VQASample]) -> np.ndarray:
        return np.array([self.marks[sample.image_id].digit for sample in samples])


def one_question_per_stamped_image(split: str, marks: dict[str, MarkRecord]) -> list[VQASample]:
    """Each stamped image once, with its first question: the question DTP ranks patches for."""
    first: dict[str, VQASample] = {}
    for sample in load_vqa(DATASET, split):
        if sample.image_id in marks:
            first.setdefault(sample.image_id, sample)
    return list(first.values())


def load_benchmark(questions: int, seed: int) -> Benchmark:
    try:
        bundle = load_mini(stage="vqa")
    except ModelNotAvailableError as error:
        raise SystemExit(f"{error}\nThis script needs the finished mini model: run `{BUILD_COMMAND}` first.") from None
    test = load_vqa(DATASET, "test", limit=questions, seed=seed)
    test_marks = mark_records(DATASET, "test")
    train_marks = mark_records(DATASET, "train")
    probe_train = one_question_per_stamped_image("train", train_marks)
    probe_test = one_question_per_stamped_image("test", test_marks)
    features = VisionFeatureCache(bundle.model, bundle.preprocess_images)
    features.add([*test, *probe_train, *probe_test])
    return Benchmark(
        bundle=bundle,
        instruction=MiniRecipe().instruction,
        features=features,
        test=test,
        probe_train=probe_train,
        probe_test=probe_test,
        marks=test_marks | train_marks,
    )


# --- one policy -----------------------------------------------------------------------------


def keep_and_sensitivity(
    selector: VisualTokenSelector, features: VisionFeatureCache, samples: Sequence[VQASample]
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per-sample keep indices, and the policy's own sensitivity map [n, N] when it scores patches."""
    keep: list[torch.Tensor] = []
    maps = []
    for start in range(0, len(samples), BATCH):
        batch = samples[start : start + BATCH]
        selection = selector(features.stack(batch), batch)
        keep.extend(indices.cpu() for indices in selection.keep)
        if selection.sensitivity is not None:
            maps.append(selection.sensitivity.cpu())
    return keep, torch.cat(maps) if maps else None


def accuracy_report(
    bench: Benchmark, keep: Sequence[torch.Tensor]
) -> tuple[dict[str, Any], list[float]]:
    """Accuracy overall, per question kind and on stamped vs plain images; per-sample scores."""
    kept = {sample.id: indices for sample, indices in zip(bench.test, keep, strict=True)}
    predictions = answer_questions(
        bench.bundle.model,
        bench.bundle.tokenizer,
        bench.features,
        bench.test,
        instruction=bench.instruction,
        visual_tokens=lambda sample, tokens: tokens[kept[sample.id]],
    )
    scores = [score_sample(prediction, sample) for prediction, sample in zip(predictions, bench.test, strict=True)]
    groups: dict[str, list[float]] = {}
    for sample, value in zip(bench.test, scores, strict=True):
        groups.setdefault(f"kind/{sample.question_kind}", []).append(value)
        image = "stamped" if sample.image_id in bench.marks else "plain"
        groups.setdefault(f"image/{image}", []).append(value)
    report = {"overall": statistics.fmean(scores)} | {
        name: statistics.fmean(values) for name, values in sorted(groups.items())
    }
    return report, scores


def mark_removal(bench: Benchmark, keep: Sequence[torch.Tensor]) -> dict[str, Any]:
    """On the questions about stamped images: the share of mark patches pruned vs of all
    patches pruned, and how often the whole mark went."""
    mark_total = mark_removed = patches_removed = stamped = whole_mark_removed = 0
    for sample, indices in zip(bench.test, keep, strict=True):
        mark = bench.mark_patches_of(sample)
        if not mark:
            continue
        kept = set(indices.tolist())
        removed = sum(patch not in kept for patch in mark)
        stamped += 1
        mark_total += len(mark)
        mark_removed += removed
        whole_mark_removed += removed == len(mark)
        patches_removed += bench.num_patches - len(kept)
    return {
        "stamped_questions": stamped,
        "mark_patches": mark_total,
        "mark_patches_removed_share": mark_removed / mark_total,
        "patches_removed_share": patches_removed / (stamped * bench.num_patches),
        "whole_mark_removed_share": whole_mark_removed / stamped,
    }


@torch.no_grad()
def wire_bytes(bench: Benchmark, keep: Sequence[torch.Tensor]) -> tuple[dict[str, list[int]], list[int]]:
    """Per sample and wire dtype: serialised bytes of its USL activation at the first cut.

    The real head runs on the sample's prompt with only its kept visual tokens (the
    client's encoding, as at the first evaluation step: no answer tokens yet), its
    output rows are packed as the client packs them, and each sample's rows and length
    go through Wire.encode into a RecordDict whose serialised size Flower would send
    (the message's small metric record is left out). Also each sample's row count.
    """
    model = bench.bundle.model
    first_cut = bench.bundle.profile.usl_cuts[0]
    encoded = encode_samples(bench.test, bench.bundle.tokenizer, bench.instruction)
    wires = {name: Wire(name) for name in WIRE_POLICIES}
    sizes: dict[str, list[int]] = {name: [] for name in WIRE_POLICIES}
    row_counts: list[int] = []
    for start in range(0, len(encoded), BATCH):
        batch = encoded[start : start + BATCH]
        visual = [
            project_visual_features(model, bench.features[item.sample.image_id][indices].unsqueeze(0))[0]
            for item, indices in zip(batch, keep[start : start + BATCH], strict=True)
        ]
        inputs = merge_multimodal_inputs(model, [item.prompt_ids for item in batch], visual, None, padding_side="left")
        hidden = run_decoder_layers(
            model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, first_cut
        )
        rows, lengths = pack_rows(hidden, inputs.attention_mask)
        row_counts.extend(lengths.tolist())
        for sample_rows, length in zip(rows.split(lengths.tolist()), lengths.split(1), strict=True):
            for name, wire in wires.items():
                payload = RecordDict({protocol.TENSORS: wire.encode({"rows": sample_rows, "lengths": length})})
                sizes[name].append(serialized_size(payload))
    return sizes, row_counts


def pooled_kept_features(features: VisionFeatureCache, samples: Sequence[VQASample], keep: Sequence[torch.Tensor]):
    """[n, 2·Dv]: mean and max of each sample's kept vision tokens."""
    rows = []
    for sample, indices in zip(samples, keep, strict=True):
        kept = features[sample.image_id][indices]
        rows.append(torch.cat([kept.mean(0), kept.amax(0)]))
    return torch.stack(rows).numpy()


def digit_probe(bench: Benchmark, keep_train: Sequence[torch.Tensor], keep_test: Sequence[torch.Tensor]) -> float:
    """Test accuracy of reading the stamped digit from the pooled kept tokens (unseen handwriting)."""
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000))
    probe.fit(pooled_kept_features(bench.features, bench.probe_train, keep_train), bench.digits(bench.probe_train))
    test_features = pooled_kept_features(bench.features, bench.probe_test, keep_test)
    return float(probe.score(test_features, bench.digits(bench.probe_test)))


def keep_all_but(bench: Benchmark, samples: Sequence[VQASample]) -> list[torch.Tensor]:
    """The ideal privacy pruner: exactly the mark patches removed."""
    keep = []
    for sample in samples:
        mark = set(bench.mark_patches_of(sample))
        keep.append(torch.tensor([patch for patch in range(bench.num_patches) if patch not in mark]))
    return keep


def only_mark(bench: Benchmark, samples: Sequence[VQASample]) -> list[torch.Tensor]:
    """The opposite: only the mark patches kept (how readable the mark is from its own tokens)."""
    return [torch.tensor(bench.mark_patches_of(sample)) for sample in samples]


def exclusion(
    bench: Benchmark, sensitivity: torch.Tensor | None, keep: Sequence[torch.Tensor]
) -> dict[str, Any] | None:
    """The SPEC's per-sample ratio summarised (mean, population std, and the median, because
    a kept mean near 0 makes single ratios huge) over all questions and by image kind."""
    if sensitivity is None:
        return None
    ratios = sensitivity_exclusion_ratios(sensitivity, keep)
    groups: dict[str, list[float]] = {"all": ratios, "stamped_images": [], "plain_images": []}
    for sample, ratio in zip(bench.test, ratios, strict=True):
        groups["stamped_images" if sample.image_id in bench.marks else "plain_images"].append(ratio)
    summaries = {}
    for name, values in groups.items():
        defined = [value for value in values if not math.isnan(value)]
        summaries[name] = asdict(summarize_exclusion(values)) | {
            "median": statistics.median(defined) if defined else math.nan
        }
    return summaries


def evaluate_policy(
    bench: Benchmark, choice: PolicyChoice, selector: VisualTokenSelector, reference: torch.Tensor
) -> tuple[dict[str, Any], list[float]]:
    started = time.perf_counter()
    keep, own_map = keep_and_sensitivity(selector, bench.features, bench.test)
    counts = [int(indices.numel()) for indices in keep]
    accuracy, scores = accuracy_report(bench, keep)
    sizes, row_counts = wire_bytes(bench, keep)
    keep_probe_train, _ = keep_and_sensitivity(selector, bench.features, bench.probe_train)
    keep_probe_test, _ = keep_and_sensitivity(selector, bench.features, bench.probe_test)
    return {
        **asdict(choice),
        "accuracy": accuracy,
        "kept_tokens": asdict(summarize_keep_counts(counts, bench.num_patches)),
        "kept_tokens_histogram": dict(sorted(Counter(counts).items())),
        # Off prunes nothing, so its ratio is undefined everywhere: no summary at all.
        "exclusion_ratio_reference": exclusion(bench, reference, keep) if choice.policy != "off" else None,
        "exclusion_ratio_own": exclusion(bench, own_map, keep),
        "mark_removal": mark_removal(bench, keep),
        "wire_bytes_per_sample": {name: statistics.fmean(values) for name, values in sizes.items()},
        "wire_rows_per_sample": statistics.fmean(row_counts),
        "digit_probe_accuracy": digit_probe(bench, keep_probe_train, keep_probe_test),
        "seconds": round(time.perf_counter() - started, 1),
    }, scores


# --- cost of the module vs the vision tower -------------------------------------------------


def flops(run: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return counter.get_total_flops()


def cost_breakdown(vision: int, module: int, dino: int, text: int) -> dict[str, Any]:
    return {
        "flops": {"vision_tower": vision, "dtp_module": module, "dino": dino, "clip_text": text},
        "module_over_vision": module / vision,
        "module_and_encoders_over_vision": (module + dino + text) / vision,
    }


def question_length(bench: Benchmark, encoders: FrozenEncoders) -> int:
    """Mean token count of the evaluated questions in the text tower (with its bos and eos)."""
    lengths = [len(encoders.tokenizer(s.question, add_special_tokens=False)["input_ids"]) + 2 for s in bench.test]
    return round(statistics.fmean(lengths))


def mini_flops(bench: Benchmark, module: QPrivVL, encoders: FrozenEncoders, text_tokens: int) -> dict[str, Any]:
    """FLOPs for one sample at mini size, on the real (trained or frozen) weights."""
    sample = bench.test[0]
    pixels = bench.bundle.preprocess_images([sample.image])
    dino_pixels = encoders.preprocess_images([sample.image])
    profile = module.profile
    patches = bench.features.stack([sample])
    question = torch.zeros(1, profile.text_hidden_size)
    dino_patches = torch.zeros(1, profile.dino_grid**2, profile.dino_hidden_size)
    input_ids = torch.full((1, text_tokens), encoders.tokenizer.bos_token_id)
    return cost_breakdown(
        flops(lambda: vision_features(bench.bundle.model, pixels)),
        flops(lambda: module(patches, question, dino_patches)),
        flops(lambda: encoders.dino(pixel_values=dino_pixels)),
        flops(lambda: encoders.text_model(input_ids=input_ids)),
    )


def paper_size_flops(text_tokens: int) -> dict[str, Any]:
    """FLOPs for one sample at llava-1.5-7b size, counted on meta tensors (no weights).

    The text tower runs without an attention mask: CLIP's mask check reads a value,
    which meta tensors do not have, and a single unpadded question needs no mask.
    """
    profile = get_pruning_profile(PAPER_PROFILE)
    llava = build_model_on_meta(profile.model)
    with torch.device("meta"):
        module = QPrivVL(profile)
        text = CLIPTextModel(
            clip_text_config(
                profile, vocab_size=CLIP_VOCAB, bos_token_id=CLIP_BOS, eos_token_id=CLIP_EOS, pad_token_id=CLIP_EOS
            )
        )
        dino = Dinov2Model(dino_config(profile))
        image = profile.model.image_size
        pixels = torch.zeros(1, 3, image, image)
        dino_pixels = torch.zeros(1, 3, profile.dino_image_size, profile.dino_image_size)
        patches = torch.zeros(1, profile.num_patches, profile.vision_hidden_size)
        question = torch.zeros(1, profile.text_hidden_size)
        dino_patches = torch.zeros(1, profile.dino_grid**2, profile.dino_hidden_size)
        input_ids = torch.zeros(1, text_tokens, dtype=torch.long)
    return cost_breakdown(
        flops(lambda: vision_features(llava, pixels)),
        flops(lambda: module(patches, question, dino_patches)),
        flops(lambda: dino(pixel_values=dino_pixels)),
        flops(lambda: text(input_ids=input_ids)),
    ) | {"meta_device": True}


@torch.no_grad()
def mini_wall_time(bench: Benchmark, module: QPrivVL, encoders: FrozenEncoders, repeats: int) -> dict[str, Any]:
    """Median seconds per batch of TIMING_BATCH test images (inputs already preprocessed),
    the four parts timed round-robin in one run so they see the same machine load."""
    samples = list({sample.image_id: sample for sample in bench.test}.values())[:TIMING_BATCH]
    images = [sample.image for sample in samples]
    pixels, dino_pixels = bench.bundle.preprocess_images(images), encoders.preprocess_images(images)
    patches = bench.features.stack(samples)
    questions = [sample.question for sample in samples]
    question_vectors = encoders.encode_questions(questions)
    dino_patches = encoders.encode_images(images)
    parts: dict[str, Callable[[], object]] = {
        "vision_tower": lambda: vision_features(bench.bundle.model, pixels),
        "dtp_module": lambda: module(patches, question_vectors, dino_patches),
        "dino": lambda: encoders.dino(pixel_values=dino_pixels),
        # Includes tokenising the questions: that is how the client encodes them.
        "clip_text": lambda: encoders.encode_questions(questions),
    }
    seconds: dict[str, list[float]] = {name: [] for name in parts}
    for _ in tqdm(range(repeats), desc="wall time (round-robin)", unit="round"):
        for name, run in parts.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "batch": len(samples),
        "repeats": repeats,
        "median_seconds": median,
        "module_over_vision": median["dtp_module"] / median["vision_tower"],
        "module_and_encoders_over_vision": (median["dtp_module"] + median["dino"] + median["clip_text"])
        / median["vision_tower"],
    }


# --- the paper's claims ---------------------------------------------------------------------


def on_fixed_grid(row: dict[str, Any]) -> bool:
    """Off and the paper's fixed grid: the curve DTP is compared with."""
    return row["policy"] == "off" or (row["policy"] == "fixed" and row["ratio"] in FIXED_RATIOS)


def fixed_curve_at(rows: dict[str, dict[str, Any]], kept: float) -> float:
    """Accuracy of the fixed-ratio curve (off + fixed grid) linearly interpolated at `kept` tokens."""
    points = sorted(
        (row["kept_tokens"]["mean"], row["accuracy"]["overall"]) for row in rows.values() if on_fixed_grid(row)
    )
    return float(np.interp(kept, [p[0] for p in points], [p[1] for p in points]))


def question_outcomes(label: str, scores: Sequence[float]) -> Outcomes:
    """One policy's per-question scores on the one model this benchmark evaluates (seed 0)."""
    return Outcomes(label, pd.DataFrame({"seed": 0, "item": range(len(scores)), "score": list(scores)}))


def check_claims(rows: dict[str, dict[str, Any]], scores: dict[str, list[float]], seed: int) -> dict[str, Any]:
    """DTP against the fixed ratio at its budget, paired question by question (analysis.stats): one
    model and one DTP preparation, so the interval is over questions only and the verdict needs the
    seeds a sweep gives (it says so)."""
    claims: dict[str, Any] = {"dtp_vs_fixed_at_similar_budget": {}, "exclusion_ratio_above_one": {}}
    for alpha in DTP_ALPHAS:
        dtp, matched = rows[dtp_label(alpha)], rows[matched_label(alpha)]
        judgement = compare(question_outcomes(matched_label(alpha), scores[matched_label(alpha)]),
                            question_outcomes(dtp_label(alpha), scores[dtp_label(alpha)]),
                            Rule(-MATCH_POINTS, ABOVE, f"DTP − fixed above −{MATCH_POINTS:g}"), seed=seed)
        estimate = judgement.estimate
        curve = fixed_curve_at(rows, dtp["kept_tokens"]["mean"])
        claims["dtp_vs_fixed_at_similar_budget"][dtp_label(alpha)] = {
            "dtp_accuracy": dtp["accuracy"]["overall"],
            "dtp_mean_kept": dtp["kept_tokens"]["mean"],
            "matched_fixed_ratio": matched["ratio"],
            "matched_fixed_kept": matched["kept_tokens"]["mean"],
            "matched_fixed_accuracy": matched["accuracy"]["overall"],
            "dtp_minus_matched_fixed": {"difference": estimate.value, "ci95_low": estimate.low,
                                        "ci95_high": estimate.high, "n": estimate.n},
            "verdict_vs_matched_fixed": str(judgement.verdict),
            "verdict_reason": judgement.reason,
            "fixed_grid_interpolated_accuracy": curve,
            "dtp_minus_fixed_grid_interpolated": dtp["accuracy"]["overall"] - curve,
        }
        for map_name in ("reference", "own"):
            summary = dtp[f"exclusion_ratio_{map_name}"]["all"]
            claims["exclusion_ratio_above_one"][f"{dtp_label(alpha)} ({map_name} map)"] = {
                "mean": summary["mean"],
                "std": summary["std"],
                "median": summary["median"],
                "paper": {"mean": PAPER_EXCLUSION_RATIO[0], "std": PAPER_EXCLUSION_RATIO[1]},
            }
    return claims


# --- output ---------------------------------------------------------------------------------


def finite(value: Any) -> Any:
    """JSON has no NaN: undefined numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def number(value: float | None, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def points(value: float) -> str:
    return f"{100 * value:+.1f}"


def render_report(results: dict[str, Any], folder: Path = RESULTS) -> Path:
    body = "\n\n".join(
        [policy_section(results), dtp_section(results), exclusion_section(results), probe_section(results),
         cost_section(results["cost"]), f"![accuracy, mark removal, digit probe and bytes per policy]({NAME}.png)"]
    )
    return write_markdown(
        NAME, "What pruning costs and buys on the mini model", body, results.get("provenance"), command=COMMAND,
        folder=folder,
    )


def kept_cell(kept: dict[str, Any]) -> str:
    if kept["q25"] == kept["q75"]:
        return f"{kept['mean']:g}"
    return f"{kept['mean']:.1f} ({kept['q25']:.0f}–{kept['q75']:.0f})"


def exclusion_cell(summaries: dict[str, Any] | None) -> str:
    if summaries is None:
        return "—"
    summary = summaries["all"]
    return f"{number(summary['mean'], '.1f')} ± {number(summary['std'], '.1f')} ({number(summary['median'], '.1f')})"


def policy_section(results: dict[str, Any]) -> str:
    setup = results["setup"]
    rows = [
        [
            label,
            kept_cell(row["kept_tokens"]),
            percent(row["accuracy"]["overall"]),
            f"{percent(row['accuracy']['image/plain'])} / {percent(row['accuracy']['image/stamped'])}",
            percent(row["mark_removal"]["mark_patches_removed_share"]),
            percent(row["mark_removal"]["patches_removed_share"]),
            percent(row["digit_probe_accuracy"]),
            exclusion_cell(row["exclusion_ratio_reference"]),
            f"{row['wire_bytes_per_sample']['fp32']:,.0f} / {row['wire_bytes_per_sample']['bf16']:,.0f}",
        ]
        for label, row in results["policies"].items()
    ]
    table = markdown_table(
        ["policy", "kept tokens (q25–q75)", "accuracy", "plain / stamped images", "mark patches removed",
         "all patches removed", "digit probe on kept tokens", "exclusion ratio: mean ± sd (median)",
         "bytes/sample at CA (fp32 / bf16)"],
        rows,
    )
    return "\n".join([
        "## Per policy",
        "",
        f"{setup['model']}. {setup['questions']:,} questions of the {setup['dataset']} "
        f"({setup['questions_on_stamped_images']:,} on stamped images), seed {setup['seed']}. Fixed ratios rank "
        f"patches with {setup['fixed_ranking']}, so they differ from DTP only in how many tokens they keep. "
        f"Exclusion ratio against {setup['exclusion_reference_map']}; bytes: {setup['wire_payload']}.",
        "",
        table,
    ])


def dtp_section(results: dict[str, Any]) -> str:
    rows = results["policies"]
    grid = [row for row in rows.values() if on_fixed_grid(row)]
    lines = [
        "## DTP against fixed ratios",
        "",
        f"- Off and the fixed grid ({span((row['kept_tokens']['mean'] for row in grid), '.0f')} tokens kept): "
        f"accuracy {span((row['accuracy']['overall'] for row in grid), '.1f', 100)}%.",
    ]
    for label, claim in results["claims"]["dtp_vs_fixed_at_similar_budget"].items():
        interval, kept = claim["dtp_minus_matched_fixed"], rows[label]["kept_tokens"]
        if "n" not in interval:
            # Measured before verdicts were paired: the same single model, judged as analysis.stats judges it.
            interval = {**interval, "n": f"1 seed × {results['setup']['questions']:,} questions"}
            claim = {**claim, "verdict_reason": f"one model: a verdict needs at least {MIN_SEEDS} seeds (measured "
                                                f"before paired verdicts, then read as: {claim['verdict_vs_matched_fixed']})",
                     "verdict_vs_matched_fixed": str(Verdict.NOT_TESTABLE)}
        lines.append(
            f"- {label} keeps {kept['mean']:.1f} tokens ({kept['min']:.0f}–{kept['max']:.0f}, sd {kept['std']:.1f}) "
            f"at {percent(claim['dtp_accuracy'])}; fixed ρ = {claim['matched_fixed_ratio']:.3f} at that budget "
            f"({claim['matched_fixed_kept']:g} tokens): {percent(claim['matched_fixed_accuracy'])}. DTP − fixed "
            f"{points(interval['difference'])} points, paired bootstrap 95% CI [{points(interval['ci95_low'])}, "
            f"{points(interval['ci95_high'])}] ({interval['n']}): **{claim['verdict_vs_matched_fixed']}** "
            f"({claim['verdict_reason']}); against the fixed-grid "
            f"curve at the same budget {points(claim['dtp_minus_fixed_grid_interpolated'])} points."
        )
    for alpha, artefact in results["setup"]["artefacts"].items():
        report = artefact["prepare_report"]
        if report is None:
            continue
        histogram = report["oracle_histogram"]["train"]
        total = sum(histogram.values())
        shares = ", ".join(f"{ratio}: {count} ({percent(count / total, 0)})" for ratio, count in histogram.items())
        fit = report["student_fit_to_oracle"]["held_out"]
        lines.append(
            f"- The oracle labels (ρ*) DTP α={alpha} learns from, of {total} training samples: {shares}. "
            f"Its student's held-out ratio error {fit['mae']:.3f} against {fit['constant_mae']:.3f} for always "
            f"guessing the mean; teacher bag accuracy {percent(report['bag_accuracy']['overall']['accuracy'])}."
        )
    return "\n".join(lines)


def exclusion_section(results: dict[str, Any]) -> str:
    lines = ["## Sensitivity exclusion ratio", ""]
    for label, claim in results["claims"]["exclusion_ratio_above_one"].items():
        paper = claim["paper"]
        lines.append(
            f"- {label}: {number(claim['mean'], '.1f')} ± {number(claim['std'], '.1f')} "
            f"(median {number(claim['median'], '.1f')}; paper {paper['mean']} ± {paper['std']}). Judged across "
            "seeds by analysis.claims.qpriv_vl on the sweeps' runs, not on this one model"
        )
    return "\n".join(lines)


def probe_section(results: dict[str, Any]) -> str:
    probe = results["digit_probe"]
    return "\n".join([
        "## What survives pruning: a probe reading the stamped digit",
        "",
        f"A logistic-regression probe on the {probe['features']}, trained on {probe['train_images']:,} stamped "
        f"training images and tested on {probe['test_images']:,} stamped test images (unseen handwriting): "
        f"chance (majority digit) {percent(probe['chance_majority'])}, no pruning {percent(probe['no_pruning'])}, "
        f"an ideal pruner that removes exactly the mark patches {percent(probe['ideal_pruner'])}, the mark's own "
        f"patches alone {percent(probe['mark_patches_only'])}; per policy in the table.",
    ])


def cost_section(cost: dict[str, Any]) -> str:
    rows = [
        [f"FLOPs at {name}", percent(part["module_over_vision"], 2), percent(part["module_and_encoders_over_vision"])]
        for name, part in (("mini", cost["flops_mini"]), (PAPER_PROFILE, cost["flops_paper_size"]))
    ]
    wall = cost["wall_time_mini"]
    rows.append([
        f"wall time at mini (batch {wall['batch']}, median of {wall['repeats']})",
        percent(wall["module_over_vision"]),
        percent(wall["module_and_encoders_over_vision"]),
    ])
    return "\n".join([
        "## DTP's cost, as a share of the vision tower's",
        "",
        markdown_table(["measure", "DTP module", "module + DINOv2 + CLIP text"], rows),
    ])


def plot(results: dict[str, Any], path: Path) -> None:
    rows = results["policies"]
    figure, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    accuracy_axis, mark_axis, probe_axis, bytes_axis = axes.flat
    colours = {label: f"C{index}" for index, label in enumerate(rows)}

    grid = sorted((row for row in rows.values() if on_fixed_grid(row)), key=lambda row: row["kept_tokens"]["mean"])
    accuracy_axis.plot(
        [row["kept_tokens"]["mean"] for row in grid], [100 * row["accuracy"]["overall"] for row in grid],
        color="gray", lw=1, zorder=1, label="off + fixed grid",
    )
    for label, row in rows.items():
        kept = row["kept_tokens"]
        error = [[kept["mean"] - kept["q25"]], [kept["q75"] - kept["mean"]]]
        marker = "*" if row["policy"] == "dtp" else ("s" if label.startswith("fixed @") else "o")
        accuracy_axis.errorbar(
            kept["mean"], 100 * row["accuracy"]["overall"], xerr=error, fmt=marker, ms=11 if marker == "*" else 7,
            color=colours[label], capsize=3, label=label,
        )
    accuracy_axis.set(
        xlabel=f"visual tokens kept per question (mean; bars: q25–q75 of {results['setup']['num_patches']})",
        ylabel="stamped easy-VQA test accuracy (%)", title="Accuracy vs token budget (pruning at inference only)",
    )
    accuracy_axis.legend(fontsize=7)

    for label, row in rows.items():
        removal = row["mark_removal"]
        mark_axis.scatter(100 * removal["patches_removed_share"], 100 * removal["mark_patches_removed_share"],
                          color=colours[label], s=60, label=label)
    mark_axis.plot([0, 100], [0, 100], color="black", ls=":", lw=1, label="y = x (blind to the mark)")
    mark_axis.set(xlabel="all patches removed (%)", ylabel="mark patches removed (%)",
                  title="Stamped test images: is the mark removed preferentially?", xlim=(-3, 103), ylim=(-3, 103))
    mark_axis.legend(fontsize=7)

    probe = results["digit_probe"]
    labels = list(rows)
    probe_axis.bar(range(len(labels)), [100 * rows[label]["digit_probe_accuracy"] for label in labels],
                   color=[colours[label] for label in labels])
    probe_axis.axhline(100 * probe["no_pruning"], color="black", ls="--", lw=1, label="no pruning")
    probe_axis.axhline(
        100 * probe["ideal_pruner"], color="tab:red", ls="-.", lw=1, label="ideal pruner (mark patches removed)"
    )
    probe_axis.axhline(100 * probe["chance_majority"], color="gray", ls=":", lw=1, label="chance (majority digit)")
    probe_axis.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
    probe_axis.set(
        ylabel="digit read from kept tokens (% of test images)", title="What survives: a probe on the kept tokens"
    )
    probe_axis.legend(fontsize=7)

    width = 0.4
    for offset, name in zip((-width / 2, width / 2), WIRE_POLICIES, strict=True):
        bytes_axis.bar([index + offset for index in range(len(labels))],
                       [rows[label]["wire_bytes_per_sample"][name] / 1024 for label in labels], width, label=name)
    bytes_axis.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
    bytes_axis.set(ylabel="KiB per sample", title="USL activation at the first cut, serialised (real wire encoder)")
    bytes_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# --- main -----------------------------------------------------------------------------------


def run(args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    bench = load_benchmark(args.questions, args.seed)
    timings["data_and_features"] = round(time.perf_counter() - clock, 1)
    clock = time.perf_counter()
    artefacts = {alpha: prepared_artefacts(cache, alpha) for alpha in DTP_ALPHAS}
    timings["artefacts"] = round(time.perf_counter() - clock, 1)

    every_sample = [*bench.test, *bench.probe_train, *bench.probe_test]

    def selector_for(choice: PolicyChoice) -> VisualTokenSelector:
        return build_policy(
            choice.policy,
            PolicyContext(
                profile=PROFILE,
                options=policy_options(get_policy(choice.policy), {"ratio": choice.ratio}),
                alpha=choice.alpha,
                artifacts=None if choice.policy == "off" else artefacts[choice.alpha][0],
                tokenizer=bench.bundle.tokenizer,
                samples=every_sample,
                cache_path=cache / "pruning_inputs.pt",
            ),
        )

    reference_selector = selector_for(PolicyChoice(dtp_label(REFERENCE_ALPHA), "dtp", alpha=REFERENCE_ALPHA))
    _, reference = keep_and_sensitivity(reference_selector, bench.features, bench.test)

    choices = [
        PolicyChoice("off", "off"),
        *(PolicyChoice(f"fixed {ratio:g}", "fixed", ratio=ratio) for ratio in FIXED_RATIOS),
        *(PolicyChoice(dtp_label(alpha), "dtp", alpha=alpha) for alpha in DTP_ALPHAS),
    ]
    rows: dict[str, dict[str, Any]] = {}
    scores: dict[str, list[float]] = {}
    clock = time.perf_counter()
    for choice in tqdm(choices, desc="policies", unit="policy"):
        rows[choice.label], scores[choice.label] = evaluate_policy(bench, choice, selector_for(choice), reference)
    # A fixed ratio at each DTP's own mean budget, ranked by the same module: only ρ̂ differs.
    for alpha in tqdm(DTP_ALPHAS, desc="fixed at DTP budgets", unit="policy"):
        ratio = 1 - rows[dtp_label(alpha)]["kept_tokens"]["mean"] / bench.num_patches
        choice = PolicyChoice(matched_label(alpha), "fixed", ratio=ratio, alpha=alpha)
        rows[choice.label], scores[choice.label] = evaluate_policy(bench, choice, selector_for(choice), reference)
    timings["policies"] = round(time.perf_counter() - clock, 1)

    clock = time.perf_counter()
    probe = digit_probe_baselines(bench, rows["off"]["digit_probe_accuracy"])
    module, encoders = reference_selector.scorer, reference_selector.inputs.encoders
    text_tokens = question_length(bench, encoders)
    cost = {
        "text_tokens_per_question": text_tokens,
        "flops_mini": mini_flops(bench, module, encoders, text_tokens),
        "flops_paper_size": paper_size_flops(text_tokens),
        "wall_time_mini": mini_wall_time(bench, module, encoders, args.timing_repeats),
    }
    timings["probe_baselines_and_cost"] = round(time.perf_counter() - clock, 1)
    return {
        "setup": setup_record(args, bench, artefacts, cache),
        "policies": rows,
        "digit_probe": probe,
        "cost": cost,
        "claims": check_claims(rows, scores, args.seed),
        "timings_seconds": timings,
    }


def digit_probe_baselines(bench: Benchmark, no_pruning: float) -> dict[str, Any]:
    majority = Counter(bench.digits(bench.probe_train).tolist()).most_common(1)[0][0]
    return {
        "train_images": len(bench.probe_train),
        "test_images": len(bench.probe_test),
        "features": "mean and max of the kept vision tokens (the projector's input), concatenated",
        "chance_majority": float((bench.digits(bench.probe_test) == majority).mean()),
        "no_pruning": no_pruning,
        "ideal_pruner": digit_probe(
            bench, keep_all_but(bench, bench.probe_train), keep_all_but(bench, bench.probe_test)
        ),
        "mark_patches_only": digit_probe(
            bench, only_mark(bench, bench.probe_train), only_mark(bench, bench.probe_test)
        ),
    }


def setup_record(
    args: argparse.Namespace, bench: Benchmark, artefacts: dict[float, tuple[Path, dict | None]], cache: Path
) -> dict[str, Any]:
    profile = bench.bundle.profile
    return {
        "model": f"{PROFILE} (VQA stage, recipe {MiniRecipe().fingerprint()}); pruning applied at inference only, "
        "no re-fine-tuning under pruning",
        "dataset": f"{DATASET} test split",
        "questions": len(bench.test),
        "questions_on_stamped_images": sum(sample.image_id in bench.marks for sample in bench.test),
        "seed": args.seed,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "num_patches": bench.num_patches,
        "k_min": profile.k_min,
        "first_usl_cut": profile.usl_cuts[0],
        "hidden_size": profile.hidden_size,
        "fixed_ranking": f"the trained DTP module of the α={REFERENCE_ALPHA:g} artefact "
        "(fixed @ DTP α=0 budget: the α=0 one)",
        "exclusion_reference_map": f"H_sens of the α={REFERENCE_ALPHA:g} DTP artefact, upsampled to the CLIP grid, "
        "for every policy",
        "exclusion_own_map": "the policy's own module's H_sens: the α=1 module for fixed ratios (so equal to the "
        "reference), "
        "the α=0 module for DTP α=0 and its matched fixed ratio; off has none",
        "wire_payload": "one sample's packed head output (prompt tokens + kept visual tokens, no answer yet) and its "
        "length, Wire.encode'd into the reply's tensor record, serialised by Flower; the reply's metric record "
        "excluded",
        "artefacts": {
            f"{alpha:g}": {"folder": str(folder), "prepare_report": report and {
                "seconds": report.get("seconds"),
                "settings": report.get("settings"),
                "student_fit_to_oracle": report["stages"]["student"].get("fit_to_oracle"),
                "bag_accuracy": report["stages"]["sensitivity"].get("bag_accuracy"),
                "oracle_histogram": {
                    part: report["stages"]["oracle"][part]["histogram"] for part in ("train", "held_out")
                },
            }}
            for alpha, (folder, report) in artefacts.items()
        },
        "cache": str(cache),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=3000, help="seeded subset of the stamped test questions")
    parser.add_argument("--seed", type=int, default=0, help="question subset, probe and bootstrap seed")
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (the machine is shared)")
    parser.add_argument(
        "--timing-repeats", type=int, default=30, help="round-robin repeats of the wall-time comparison"
    )
    parser.add_argument(
        "--cache", type=Path, default=None,
        help="folder for the DTP artefacts and cached encoder inputs (default: the mini build's cache root)",
    )
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.report:
        print(f"wrote {render_report(read_json(NAME))}")
        return
    torch.set_num_threads(args.threads)
    stamp = provenance_for(args, seeds={"seed": args.seed}, models=[PROFILE])
    started = time.perf_counter()
    recipe = MiniRecipe()
    # Keyed by the mini build: artefacts prepared against another build would rank for another model.
    cache = args.cache or cache_root() / "pruning-tradeoffs" / recipe.fingerprint()
    with threadpool_limits(args.threads):
        results = run(args, cache)
    results["seconds"] = round(time.perf_counter() - started, 1)
    path = write_json(NAME, finite({"provenance": stamp} | results))
    plot(results, RESULTS / "pruning_tradeoffs.png")
    # Rendered from the file, so the markdown is exactly what --report makes of it.
    print(render_report(read_json(NAME)).read_text())
    print(f"total {results['seconds']:.0f} s; wrote {path}, .png and .md")


if __name__ == "__main__":
    main()
