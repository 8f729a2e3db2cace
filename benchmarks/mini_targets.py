"""Measure the mini model against its targets (issue: foundation) and plot the curves.

    python benchmarks/mini_targets.py [--fresh-build] [--curve-samples N] [--seed S]
    python benchmarks/mini_targets.py --report

--fresh-build builds the model from nothing in a temporary cache and reports the
seconds per stage; otherwise the cached build is used (built first if missing).
Writes results/mini_targets.json and .png, and results/mini_targets.md from the JSON;
--report only re-renders the markdown.
"""

import argparse
import random
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from analysis.provenance import model_identity
from vlm.answering import answer_questions
from vlm.features import VisionFeatureCache
from vlm.mini import MiniFolder, MiniRecipe, build_mini, load_mini
from vlm.mini.attributes import COLORS, SHAPES, image_attributes
from vlm.mini.stages import own_wording_yes_no
from vlm.segments import llava_parts
from vqa import aggregate_accuracy, load_vqa

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

NAME = "mini_targets"
COMMAND = "python benchmarks/mini_targets.py"
KEEP_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# The foundation issue's targets for the finished model: overall, colour and shape at
# least this, and yes/no above what the question alone predicts.
TARGET_ACCURACY = 0.9


def accuracy_table(predictions, samples) -> dict:
    report = aggregate_accuracy(predictions, samples)
    return {"overall": report.overall.accuracy} | {k: g.accuracy for k, g in report.by_question_kind.items()}


def question_only_prior(train, test) -> dict:
    """Accuracy of answering each test question with its most common training answer."""
    by_question = defaultdict(Counter)
    for sample in train:
        by_question[sample.question][sample.answer] += 1
    overall = Counter(s.answer for s in train).most_common(1)[0][0]
    predictions = [
        by_question[s.question].most_common(1)[0][0] if s.question in by_question else overall for s in test
    ]
    return accuracy_table(predictions, test)


def random_keep(fraction: float, seed: int):
    """Keep a random share of visual tokens (at least one), in their original order."""

    def keep(sample, tokens: torch.Tensor) -> torch.Tensor:
        count = max(1, round(fraction * tokens.shape[0]))
        rng = random.Random(f"{seed}:{sample.id}")
        return tokens[sorted(rng.sample(range(tokens.shape[0]), count))]

    return keep


@torch.no_grad()
def one_token_probe(model, preprocess, train, test, seed: int) -> dict:
    """How much of the image one random visual token carries, at each vision layer.

    A logistic-regression probe reads shape (and colour) from a single random patch
    token of each image; accuracy per layer, on test images, against chance.
    """
    tower = llava_parts(model).vision_tower
    results = {}
    per_split = {}
    for name, samples in (("train", train), ("test", test)):
        labels = image_attributes(samples)
        first = {s.image_id: s for s in reversed(samples)}
        ids = [i for i in sorted(first) if labels[i].shape and labels[i].color]
        hidden = []
        for start in range(0, len(ids), 500):
            pixels = preprocess([first[i].image for i in ids[start : start + 500]])
            hidden.append(torch.stack(tower(pixel_values=pixels, output_hidden_states=True).hidden_states)[:, :, 1:])
        hidden = torch.cat(hidden, dim=1)  # [layers + 1, images, N, Dv]
        generator = torch.Generator().manual_seed(seed)
        token = torch.randint(hidden.shape[2], (hidden.shape[1],), generator=generator)
        one_token = hidden[:, torch.arange(hidden.shape[1]), token]  # [layers + 1, images, Dv]
        per_split[name] = (
            one_token.numpy(),
            np.array([SHAPES.index(labels[i].shape) for i in ids]),
            np.array([COLORS.index(labels[i].color) for i in ids]),
        )
    (x_train, shape_train, color_train), (x_test, shape_test, color_test) = per_split["train"], per_split["test"]
    for layer in range(x_train.shape[0]):
        scores = {}
        for attribute, y_train, y_test in (("shape", shape_train, shape_test), ("color", color_train, color_test)):
            probe = LogisticRegression(max_iter=2000).fit(x_train[layer], y_train)
            scores[attribute] = float(probe.score(x_test[layer], y_test))
        results[layer] = scores
    return {"by_layer": results, "chance": {"shape": 1 / len(SHAPES), "color": 1 / len(COLORS)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh-build", action="store_true", help="build from nothing and time each stage")
    parser.add_argument("--curve-samples", type=int, default=3000, help="test questions per keep-curve point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.report:
        print(f"wrote {render_report(read_json(NAME))}")
        return
    recipe = MiniRecipe()
    stamp = provenance_for(args, seeds={"seed": args.seed, "recipe.seed": recipe.seed}, models=())
    root = Path(tempfile.mkdtemp(prefix="qpriv-mini-")) if args.fresh_build else None
    folder = MiniFolder(recipe, root)
    if args.fresh_build or not folder.lora.is_file():
        build_mini(recipe, root=root)
    # Known only once built (a --fresh-build builds under its own root).
    stamp["models"] = {"mini": model_identity("mini", root)}
    build_report = folder.read_report()

    train, test = load_vqa("easyvqa", "train"), load_vqa("easyvqa", "test")
    results: dict = {"provenance": stamp, "build": build_report, "test_questions": len(test)}
    results["question_only_prior"] = question_only_prior(train, test)
    for stage in ("base", "vqa"):
        bundle = load_mini(stage=stage, recipe=recipe, root=root)
        features = VisionFeatureCache(bundle.model, bundle.preprocess_images)
        features.load(folder.features)

        def run(samples, visual_tokens=None):
            return accuracy_table(
                answer_questions(
                    bundle.model, bundle.tokenizer, features, samples,
                    instruction=recipe.instruction, visual_tokens=visual_tokens,
                ),
                samples,
            )

        results[stage] = {"full": run(test)}
        if stage == "base":
            results[stage]["own_yes_no_templates"] = run(
                own_wording_yes_no(test, image_attributes(test), recipe, random.Random(args.seed))
            )
            continue
        image_ids = sorted({s.image_id for s in test})
        other_image = dict(zip(image_ids, image_ids[1:] + image_ids[:1]))
        results[stage]["no_visual_tokens"] = run(test, lambda s, t: t[:0])
        results[stage]["swapped_image"] = run(test, lambda s, t: features[other_image[s.image_id]])
        subset = test.select(random.Random(args.seed).sample(range(len(test)), min(args.curve_samples, len(test))))
        results[stage]["curve_questions"] = len(subset)
        results[stage]["random_keep_curve"] = {
            fraction: run(subset, random_keep(fraction, args.seed)) for fraction in KEEP_FRACTIONS
        }
        results["one_token_probe"] = one_token_probe(bundle.model, bundle.preprocess_images, train, test, args.seed)
        results["vision_feature_layer"] = llava_parts(bundle.model).config.vision_feature_layer

    path = write_json(NAME, results)
    plot(results, RESULTS / "mini_targets.png")
    # Rendered from the file, so the markdown is exactly what --report makes of it.
    print(render_report(read_json(NAME)).read_text())
    print(f"wrote {path}, .png and .md")


def render_report(results: dict, folder: Path = RESULTS) -> Path:
    body = "\n\n".join(
        [accuracy_section(results), build_section(results["build"]), keep_curve_section(results),
         probe_section(results["one_token_probe"], results["vision_feature_layer"]),
         "![the base's yes/no check by step, accuracy vs random visual-token keep, and a one-token probe by vision "
         "layer](mini_targets.png)"]
    )
    return write_markdown(
        NAME, "The mini model against its targets", body, results.get("provenance"), command=COMMAND, folder=folder
    )


def accuracy_section(results: dict) -> str:
    kinds = ("overall", "color", "shape", "yes/no")
    prior, base, vqa = results["question_only_prior"], results["base"], results["vqa"]
    own = base["own_yes_no_templates"]

    def row(label: str, table: dict) -> list:
        return [label, *(percent(table[kind]) for kind in kinds)]

    finished = [f"**{cell}**" for cell in row("finished mini model", vqa["full"])]
    table = markdown_table(
        ["", "overall", "colour", "shape", "yes/no"],
        [
            row("question-only prior (most common training answer per question)", prior),
            row("base stage (before LoRA), easy-VQA's wording", base["full"]),
            ["base stage on its own yes/no wordings", percent(own["overall"]), "—", "—",
             f"colour {percent(own['base color yes/no'])}, shape {percent(own['base shape yes/no'])}"],
            finished,
            row("… with no visual tokens", vqa["no_visual_tokens"]),
            row("… with another image's visual tokens", vqa["swapped_image"]),
        ],
    )
    full = vqa["full"]

    def verdict(holds: bool) -> str:
        return "holds" if holds else "**missed**"

    targets = [
        f"- overall ≥ {percent(TARGET_ACCURACY, 0)}: {verdict(full['overall'] >= TARGET_ACCURACY)} "
        f"({percent(full['overall'])})",
        *(
            f"- {label} ≥ {percent(TARGET_ACCURACY, 0)}: {verdict(full[kind] >= TARGET_ACCURACY)} "
            f"({percent(full[kind])})"
            for kind, label in (("color", "colour"), ("shape", "shape"))
        ),
        f"- yes/no above the question-only prior: {verdict(full['yes/no'] > prior['yes/no'])} "
        f"({percent(full['yes/no'])} against {percent(prior['yes/no'])})",
        f"- the image matters: removing its visual tokens costs "
        f"{100 * (full['overall'] - vqa['no_visual_tokens']['overall']):.1f} points overall, "
        f"another image's tokens {100 * (full['overall'] - vqa['swapped_image']['overall']):.1f}",
    ]
    return "\n".join(
        [f"## Accuracy on the full easy-VQA test split ({results['test_questions']:,} questions)", "", table, "",
         "Targets:", "", *targets]
    )


def build_section(build: dict) -> str:
    stages = build["stages"]
    table = markdown_table(
        ["stage", "seconds", "final loss"],
        [[name, f"{stage['seconds']:.0f}", f"{stage['final_loss']:.3g}" if "final_loss" in stage else "—"]
         for name, stage in stages.items()],
    )
    threshold = build["recipe"]["base_check_accuracy"]
    attempts = [
        f"- seed {attempt['seed']}: "
        + (f"passed the {percent(threshold, 0)} check at few-token step {attempt['learned_at_step']}"
           if attempt.get("learned_at_step") is not None else f"never passed the {percent(threshold, 0)} check")
        + f", {attempt['few_token_steps']:,} few-token steps; checks "
        + ", ".join(f"{step}: {percent(accuracy, 0)}" for step, accuracy in attempt["yes_no_checks"].items())
        for attempt in stages["base"]["attempts"]
    ]
    return "\n".join(
        [f"## The build: {build['total_seconds']:.0f} s ({build['total_seconds'] / 60:.1f} minutes)", "", table, "",
         "The base stage's own-wording yes/no on held-out training images, per try:", "", *attempts]
    )


def keep_curve_section(results: dict) -> str:
    curve = results["vqa"]["random_keep_curve"]
    kinds = ("overall", "color", "shape", "yes/no")
    table = markdown_table(
        ["visual tokens kept at random", "overall", "colour", "shape", "yes/no"],
        [[percent(float(fraction), 0), *(percent(point[kind]) for kind in kinds)] for fraction, point in curve.items()],
    )
    sample = f" ({results['vqa']['curve_questions']:,} test questions)" if "curve_questions" in results["vqa"] else ""
    return "\n".join(
        [f"## Accuracy when a random share of the visual tokens is kept{sample}", "",
         f"Overall {span((point['overall'] for point in curve.values()), '.1f', 100)}% from "
         f"{percent(float(min(curve, key=float)), 0)} to {percent(float(max(curve, key=float)), 0)} kept.", "", table]
    )


def probe_section(probe: dict, feature_layer: int) -> str:
    layers = probe["by_layer"]
    chance = probe["chance"]
    table = markdown_table(
        ["vision layer (0 = embeddings)", "shape", "colour"],
        [[layer, percent(scores["shape"]), percent(scores["color"])] for layer, scores in layers.items()],
    )
    return "\n".join(
        ["## What one random visual token carries", "",
         "A logistic-regression probe reads shape and colour from a single random patch token of each test "
         f"image, per vision layer (chance: shape {percent(chance['shape'])}, colour {percent(chance['color'])}); "
         f"LLaVA reads the features of layer {feature_layer}.",
         "", table]
    )


def plot(results: dict, path: Path) -> None:
    figure, (checks, curve, probe) = plt.subplots(1, 3, figsize=(16, 4))
    for attempt in results["build"]["stages"]["base"]["attempts"]:
        steps = [int(step) for step in attempt["yes_no_checks"]]
        checks.plot(steps, list(attempt["yes_no_checks"].values()), marker="o", label=f"seed {attempt['seed']}")
    checks.axhline(results["build"]["recipe"]["base_check_accuracy"], color="gray", ls="--", label="pass")
    checks.set(xlabel="base stage, few-token step", ylabel="own-wording yes/no (held-out training images)",
               title="Base: the yes/no comparison emerging")
    checks.legend(fontsize=8)
    keep = results["vqa"]["random_keep_curve"]
    fractions = [float(f) for f in keep]
    for kind in ("overall", "yes/no", "shape", "color"):
        curve.plot([100 * f for f in fractions], [keep[f][kind] for f in keep], marker="o", label=kind)
    curve.axhline(results["vqa"]["no_visual_tokens"]["overall"], color="gray", ls="--", label="no visual tokens")
    curve.axhline(results["question_only_prior"]["overall"], color="black", ls=":", label="question-only prior")
    curve.set(xlabel="visual tokens kept at random (%)", ylabel="easy-VQA test accuracy", title="Random token keep")
    curve.legend(fontsize=8)
    layers = results["one_token_probe"]["by_layer"]
    chance = results["one_token_probe"]["chance"]
    for attribute in ("shape", "color"):
        probe.plot([int(l) for l in layers], [layers[l][attribute] for l in layers], marker="o", label=attribute)
        probe.axhline(chance[attribute], ls=":", color="gray")
    probe.set(xlabel="vision layer (0 = embeddings)", ylabel="probe accuracy (test images)",
              title="One random visual token: what it carries")
    probe.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
