"""QPriv-VL's own evaluation on the scene testbed, every policy at equal tokens (issue 40, item 2).

    python benchmarks/qpriv_evaluation.py --dtp DIR [--dtp DIR ...] [--parts policies,irrelevant,deletion]
                                          [--questions N] [--deletion-questions N] [--seed S] [--threads T]
    python benchmarks/qpriv_evaluation.py --report

The finished `mini-scenes` model (VQA stage) answers the `scenes-stamped` test questions with
each policy applied at inference (no re-fine-tuning; the sweep fine-tunes under each policy).
Policies: off; DTP from each prepared folder given (`--dtp`, one per α: the α sweep at inference);
and at two budgets, DTP's own mean (the first folder's) and 25% of the tokens, the fixed ratio
ranked by the first folder's module and the efficiency pruners (random, fastv, sparsevlm, dart,
visionzip). SPEC §1's metrics, in parts (each saved as it finishes; a rerun measures what is missing):

- policies: accuracy (per question kind), kept tokens, the share of the stamped digit's patches
  whose content is sent (kept, or merged into a sent row), and a digit probe trained on the
  policy's own sent rows of training-split stamped images (an attacker that knows the policy),
  tested on the test split's. The privacy subset (the top --subset-share of test images by the
  first DTP folder's maximum patch sensitivity, SPEC's "top-N by maximum DINOv2 sensitivity")
  reports accuracy and digit patches sent there beside the whole set.
- irrelevant: the irrelevant-question probe. Each test image with another image's question
  (cross-image: scored by what this image answers, `vqa.scenes.answer_in_scene`; a refusal is
  right where it cannot answer), a word salad of its own question (nonsense), and a relation
  to an object it does not hold (false premise). A refusal is the benchmark's refusal answer,
  any other non-empty answer a hallucination.
- deletion: Chefer et al.'s attention-propagation relevance (R ← R + E_h[(∇A ⊙ A)⁺] R over the
  decoder's layers, for the answer's first token) over the sent rows; accuracy as the most
  relevant rows are deleted, against deleting as many at random (off, the first DTP, random at
  DTP's budget).

Intervals are 95%: Wilson for a share, a paired percentile bootstrap (same questions) for a
difference. Writes results/qpriv_evaluation.json and .md from it; --report only re-renders.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from report import (
    REPORT_HELP, RESULTS, add_allow_dirty, markdown_table, percent, provenance_for, read_json, write_json, write_markdown,
)

sys.path.insert(0, str(Path(__file__).parent))
from testbed import DATASET, PROFILE, Testbed, bits, linear_probe, paired_bootstrap, share, unbits  # noqa: E402

NAME = "qpriv_evaluation"
COMMAND = "python benchmarks/qpriv_evaluation.py"
PARTS = ("policies", "irrelevant", "deletion")
EFFICIENCY = ("random", "fastv", "sparsevlm", "dart", "visionzip")
QUARTER = 0.75  # the pruned share at which 25% of the tokens are kept
DELETION_SHARES = (0.1, 0.25, 0.5)
MAX_NEW_TOKENS = 2
BATCH = 256


# --- policies ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyRun:
    """One evaluated policy: its label, the registered policy, its options and, for QPriv-VL's
    policies, the prepared folder it reads."""

    label: str
    family: str
    policy: str
    options: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None


def folder_alpha(folder: Path) -> float:
    return float(json.loads((folder / "prepare.json").read_text())["settings"]["alpha"])


@dataclass
class Sent:
    """One question's selection: the kept positions, the merging weights (None: kept as they are)
    and the patches whose content is sent."""

    keep: torch.Tensor
    mixing: torch.Tensor | None
    sources: torch.Tensor

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[self.keep] if self.mixing is None else self.mixing.to(tokens.dtype) @ tokens


class Evaluation:
    """The testbed's model and data, the policies' selectors, and answers through them."""

    def __init__(self, bed: Testbed, folders: Sequence[Path]) -> None:
        self.bed, self.folders = bed, list(folders)
        self.selections: dict[str, dict[str, Sent]] = {}
        self.sensitivity: dict[str, float] = {}

    def context(self, run: PolicyRun, samples: Sequence[Any]):
        from pruning import PolicyContext, get_policy, policy_options
        from pruning.prepare import prepared_policy_settings

        bed = self.bed
        qpriv = prepared_policy_settings(run.folder) if run.folder is not None else {"seed": bed.args.seed}
        return PolicyContext(
            profile=bed.profile.name, options=policy_options(get_policy(run.policy), run.options),
            tokenizer=bed.bundle.tokenizer, samples=list(samples), model=bed.bundle.model,
            instruction=bed.instruction, pixel_values=bed.features.sample_pixel_values, **qpriv)

    def select(self, run: PolicyRun, samples: Sequence[Any]) -> dict[str, Sent]:
        """Each sample's selection under `run` (cached per policy and sample id)."""
        from pruning import build_policy

        done = self.selections.setdefault(run.label, {})
        todo = [s for s in samples if s.id not in done]
        if todo:
            self.bed.features.add(todo, progress=False)
            selector = build_policy(run.policy, self.context(run, todo))
            with torch.no_grad():
                for start in range(0, len(todo), BATCH):
                    batch = todo[start : start + BATCH]
                    selection = selector(self.bed.features.stack(batch), batch)
                    mixing = selection.mixing or [None] * len(batch)
                    for index, (sample, keep, sources) in enumerate(zip(batch, selection.keep, selection.sources(),
                                                                        strict=True)):
                        done[sample.id] = Sent(keep.cpu(), None if mixing[index] is None else mixing[index].cpu(),
                                               sources.cpu())
                        if selection.sensitivity is not None and run.folder == self.folders[0]:
                            self.sensitivity[sample.image_id] = float(selection.sensitivity[index].max())
        return {s.id: done[s.id] for s in samples}

    def answer(self, samples: Sequence[Any], rows_of: Callable[[Any, torch.Tensor], torch.Tensor] | None) -> list[str]:
        from vlm.answering import answer_questions

        bed = self.bed
        bed.features.add(samples, progress=False)
        return answer_questions(bed.bundle.model, bed.bundle.tokenizer, bed.features, samples,
                                instruction=bed.instruction, visual_tokens=rows_of, max_new_tokens=MAX_NEW_TOKENS,
                                batch_size=BATCH, progress=not bed.args.no_progress)

    def answer_under(self, run: PolicyRun, samples: Sequence[Any]) -> list[str]:
        if run.policy == "off":
            return self.answer(samples, None)
        sent = self.select(run, samples)
        return self.answer(samples, lambda sample, tokens: sent[sample.id].rows(tokens))


def policy_runs(evaluation: Evaluation, budget_ratio: float) -> list[PolicyRun]:
    """off, DTP per folder, then the fixed ratio and the efficiency pruners at DTP's budget and at 25%."""
    folders = evaluation.folders
    runs = [PolicyRun("off", "off", "off")]
    runs += [dtp_run(folder) for folder in folders]
    for name, ratio in (("dtp budget", budget_ratio), ("25%", QUARTER)):
        runs.append(PolicyRun(f"fixed @{name}", "fixed", "fixed", {"ratio": ratio}, folders[0]))
        runs += [PolicyRun(f"{policy} @{name}", policy, policy, {"ratio": ratio}) for policy in EFFICIENCY]
    return runs


def dtp_run(folder: Path) -> PolicyRun:
    return PolicyRun(f"dtp α={folder_alpha(folder):g}", "dtp", "dtp", folder=folder)


def first_dtp(evaluation: Evaluation) -> PolicyRun:
    return dtp_run(evaluation.folders[0])


def dtp_budget_ratio(evaluation: Evaluation) -> tuple[float, float]:
    """The pruned share at which a ratio policy keeps the first DTP's mean token count, and that mean."""
    bed = evaluation.bed
    kept = statistics.fmean(len(s.keep) for s in evaluation.select(first_dtp(evaluation), bed.test).values())
    return 1 - kept / bed.num_patches, kept


# --- part: policies -----------------------------------------------------------------------------------


def pooled(rows: Sequence[torch.Tensor]) -> np.ndarray:
    """One vector per sample from its sent rows: their mean and their max, concatenated."""
    return torch.stack([torch.cat([r.float().mean(0), r.float().max(0).values]) for r in rows]).numpy()


def measure_policies(evaluation: Evaluation, runs: Sequence[PolicyRun], subset_share: float,
                     partial: dict[str, Any], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from vqa import score_sample

    bed = evaluation.bed
    test = bed.test
    stamped = {split: bed.stamped_probe_samples(split) for split in ("train", "test")}
    digits = {split: np.array([bed.marks[s.image_id].digit for s in samples]) for split, samples in stamped.items()}
    bed.features.add([*test, *stamped["train"], *stamped["test"]], progress=False)
    rows: dict[str, Any] = dict(partial.get("policies", {}))
    for run in runs:
        if run.label in rows:
            continue
        answers = evaluation.answer_under(run, test)
        scores = [score_sample(a, s) for a, s in zip(answers, test, strict=True)]
        if run.policy == "off":
            kept = [bed.num_patches] * len(test)
            mark_sent = [1.0 if bed.mark_patches_of(s) else None for s in test]
            probe_rows = {split: [bed.features[s.image_id] for s in samples] for split, samples in stamped.items()}
        else:
            sent = evaluation.select(run, test)
            kept = [len(sent[s.id].keep) for s in test]
            mark_sent = []
            for sample in test:
                mark = set(bed.mark_patches_of(sample))
                crossing = set(sent[sample.id].sources.tolist())
                mark_sent.append(len(mark & crossing) / len(mark) if mark else None)
            probe_rows = {}
            for split, samples in stamped.items():
                chosen = evaluation.select(run, samples)
                probe_rows[split] = [chosen[s.id].rows(bed.features[s.image_id]) for s in samples]
        rows[run.label] = {
            "family": run.family, "policy": run.policy, "options": run.options,
            "folder": None if run.folder is None else str(run.folder),
            "scores": bits(scores), "kept": kept, "mark_sent": mark_sent,
            "digit_probe": linear_probe(pooled(probe_rows["train"]), digits["train"], pooled(probe_rows["test"]),
                                        digits["test"]),
        }
        save({"policies": rows})
    # The privacy subset: the images the first DTP's sensitivity map rates most sensitive (all
    # images when no DTP is evaluated).
    images = sorted({s.image_id for s in test})
    subset = set(images)
    if evaluation.folders:
        evaluation.select(first_dtp(evaluation), test)
        images.sort(key=lambda image: -evaluation.sensitivity[image])
        subset = set(images[: max(1, round(subset_share * len(images)))])
    in_subset = [i for i, s in enumerate(test) if s.image_id in subset]
    stamped_subset = sum(bool(bed.mark_patches_of(test[i])) for i in in_subset)
    full = unbits(rows["off"]["scores"])
    summary = {}
    for label, row in rows.items():
        scores = unbits(row["scores"])
        marks = [m for m in row["mark_sent"] if m is not None]
        subset_marks = [row["mark_sent"][i] for i in in_subset if row["mark_sent"][i] is not None]
        summary[label] = {
            "family": row["family"], "options": row["options"],
            "accuracy": share(scores), "kept_share": statistics.fmean(row["kept"]) / bed.num_patches,
            "mark_sent_share": {"value": statistics.fmean(marks) if marks else None, "n": len(marks)},
            "digit_probe": row["digit_probe"],
            "loss_vs_off": paired_bootstrap(full, scores, bed.args.seed),
            "privacy_subset": {
                "accuracy": share([scores[i] for i in in_subset]),
                "mark_sent_share": {"value": statistics.fmean(subset_marks) if subset_marks else None,
                                    "n": len(subset_marks)},
            },
        }
    return {"questions": len(test), "probe_images": {split: len(samples) for split, samples in stamped.items()},
            "privacy_subset": {"images": len(subset), "of_images": len(images), "questions": len(in_subset),
                               "stamped_questions": stamped_subset, "share": subset_share if evaluation.folders else 1.0,
                               "rule": "the top share of test images by the first DTP folder's maximum patch sensitivity"
                               if evaluation.folders else "every test image (no DTP folder to rank them)"},
            "policies": summary, "per_question": rows}


# --- part: irrelevant questions -------------------------------------------------------------------------


def irrelevant_probes(bed: Testbed, seed: int) -> dict[str, list]:
    """Per kind, the probe samples (the test images' first questions replaced) with their truth."""
    from vqa.adapters.scenes import split_scenes
    from vqa.scenes import REFUSAL_ANSWER, RELATIONS, answer_in_scene

    rng = random.Random(f"irrelevant:{seed}")
    scenes = {scene.image_id: scene for scene in split_scenes(bed.spec, "test")}
    firsts: dict[str, Any] = {}
    for sample in bed.test:
        firsts.setdefault(sample.image_id, sample)
    samples = list(firsts.values())
    questions = [s.question for s in bed.test]
    probes: dict[str, list] = {"cross_image": [], "nonsense": [], "false_premise": []}
    for sample in samples:
        scene = scenes[sample.image_id]
        foreign = rng.choice([q for q in questions if q not in {x.question for x in scene.questions}])
        truth = answer_in_scene(scene, foreign)
        if truth is not None:
            probes["cross_image"].append(replace(sample, id=f"{sample.id}/cross", question=foreign, answer=truth,
                                                 answers=(), question_kind="cross_image"))
        words = sample.question.rstrip("?").split()
        for _ in range(10):
            rng.shuffle(words)
            salad = " ".join(words) + "?"
            if answer_in_scene(scene, salad) is None:
                probes["nonsense"].append(replace(sample, id=f"{sample.id}/nonsense", question=salad,
                                                  answer=REFUSAL_ANSWER, answers=(), question_kind="nonsense"))
                break
        present = {(obj.color, obj.shape) for obj in scene.objects}
        absent = [(c, s) for c in bed.spec.colors for s in bed.spec.shapes if (c, s) not in present]
        color, shape = rng.choice(absent)
        question = f"What shape is {rng.choice(list(RELATIONS))} the {color} {shape}?"
        probes["false_premise"].append(replace(sample, id=f"{sample.id}/premise", question=question,
                                               answer=REFUSAL_ANSWER, answers=(), question_kind="false_premise"))
    return probes


def measure_irrelevant(evaluation: Evaluation, runs: Sequence[PolicyRun]) -> dict[str, Any]:
    from vqa.scenes import REFUSAL_ANSWER

    probes = irrelevant_probes(evaluation.bed, evaluation.bed.args.seed)
    result: dict[str, Any] = {"probes": {kind: len(samples) for kind, samples in probes.items()}, "policies": {}}
    for run in runs:
        row = {}
        for kind, samples in probes.items():
            answers = [a.strip().lower() for a in evaluation.answer_under(run, samples)]
            unanswerable = [i for i, s in enumerate(samples) if s.answer == REFUSAL_ANSWER]
            answerable = [i for i, s in enumerate(samples) if s.answer != REFUSAL_ANSWER]
            row[kind] = {
                "refusal": share([float(answers[i] == REFUSAL_ANSWER) for i in unanswerable]),
                "hallucination": share([float(answers[i] not in ("", REFUSAL_ANSWER)) for i in unanswerable]),
                **({"answerable_accuracy": share([float(answers[i] == samples[i].answer.lower()) for i in answerable])}
                   if answerable else {}),
            }
        result["policies"][run.label] = row
    return result


# --- part: deletion -------------------------------------------------------------------------------------


def chefer_relevance(evaluation: Evaluation, sample: Any, rows: torch.Tensor) -> torch.Tensor:
    """Relevance [k] of each sent visual row to the model's first answer token: Chefer et al.'s
    rule for self-attention, R = I, then per decoder layer R ← R + E_h[(∇A ⊙ A)⁺] R, read at the
    last prompt position (written here: no library ships the rule for this decoder)."""
    from vlm.segments import llava_parts, merge_multimodal_inputs, project_visual_features
    from vqa import build_prompt

    bed = evaluation.bed
    model, tokenizer = bed.bundle.model, bed.bundle.tokenizer
    parts = llava_parts(model)
    prompt = torch.tensor(tokenizer(build_prompt(sample.question, instruction=bed.instruction),
                                    add_special_tokens=False)["input_ids"])
    language = parts.language_model
    implementation = language.config._attn_implementation
    language.config._attn_implementation = "eager"  # the only implementation that returns the weights
    try:
        with torch.enable_grad():
            visual = project_visual_features(model, rows.unsqueeze(0).to(parts.lm_head.weight.dtype))[0]
            inputs = merge_multimodal_inputs(model, [prompt], [visual.detach()])
            hidden = inputs.hidden_states.detach().requires_grad_(True)
            output = language(inputs_embeds=hidden, attention_mask=inputs.attention_mask,
                              position_ids=inputs.position_ids, output_attentions=True)
            for weights in output.attentions:
                weights.retain_grad()
            logits = parts.lm_head(output.last_hidden_state[:, -1])
            logits[0, logits[0].argmax()].backward()
    finally:
        language.config._attn_implementation = implementation
    length = hidden.shape[1]
    relevance = torch.eye(length)
    for weights in output.attentions:
        cam = (weights.grad * weights).detach()[0].clamp(min=0).mean(0).float()
        relevance = relevance + cam @ relevance
    return relevance[-1, inputs.visual_token_mask[0]]


def measure_deletion(evaluation: Evaluation, runs: Sequence[PolicyRun], questions: int) -> dict[str, Any]:
    from vqa import score_sample

    bed = evaluation.bed
    samples = bed.test[:questions]
    result: dict[str, Any] = {"questions": len(samples), "shares": list(DELETION_SHARES), "policies": {}}
    for run in runs:
        sent = None if run.policy == "off" else evaluation.select(run, samples)
        rows_of = {s.id: bed.features[s.image_id] if sent is None else sent[s.id].rows(bed.features[s.image_id])
                   for s in samples}
        order = {s.id: chefer_relevance(evaluation, s, rows_of[s.id]).argsort(descending=True) for s in samples}
        curves: dict[str, list] = {"relevant_first": [], "random": []}
        for deleted_share in (0.0, *DELETION_SHARES):
            for how in curves:
                def kept_rows(sample, tokens, how=how, deleted_share=deleted_share):
                    rows = rows_of[sample.id]
                    count = min(len(rows) - 1, round(deleted_share * len(rows)))
                    ranked = (order[sample.id] if how == "relevant_first"
                              else torch.randperm(len(rows), generator=torch.Generator().manual_seed(
                                  zlib.crc32(f"{bed.args.seed}:{sample.id}".encode()))))
                    keep = ranked[count:].sort().values
                    return rows[keep]

                answers = evaluation.answer(samples, kept_rows)
                curves[how].append(share([score_sample(a, s) for a, s in zip(answers, samples, strict=True)]))
        result["policies"][run.label] = curves
    return result


# --- the run --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    results = read_json(NAME, out) if (out / f"{NAME}.json").is_file() else {}
    measured_on = provenance_for(args, seeds={"seed": args.seed}, models=[args.profile])
    bed = Testbed(args)
    key = {"weights_digest": bed.build["weights_digest"], "questions": len(bed.test), "seed": args.seed,
           "dtp": [str(folder.resolve()) for folder in args.dtp], "subset_share": args.subset_share,
           "deletion_questions": args.deletion_questions}
    if results.get("key") != key or args.redo:
        results = {"key": key, "parts": {}}
    results["model"] = {k: v for k, v in bed.build.items() if k != "features_file"}
    evaluation = Evaluation(bed, args.dtp)
    ratio, kept = dtp_budget_ratio(evaluation)
    results["budgets"] = {"dtp_ratio": ratio, "dtp_mean_kept": kept, "quarter_ratio": QUARTER,
                          "num_patches": bed.num_patches}
    runs = policy_runs(evaluation, ratio)

    def save() -> None:
        results["provenance"] = measured_on
        results["settings"] = {"profile": args.profile, "dataset": DATASET, "seed": args.seed,
                               "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
        write_json(NAME, results, out)

    def measured(part: str, compute: Callable[[], dict[str, Any]]) -> None:
        if "result" in results["parts"].get(part, {}):
            print(f"{part}: already measured, kept")
            return
        clock, load = time.perf_counter(), os.getloadavg()
        result = compute()
        results["parts"][part] = {"result": result, "seconds": round(time.perf_counter() - clock, 1),
                                  "load_average_before": list(load), "load_average_after": list(os.getloadavg())}
        save()
        print(f"{part}: {results['parts'][part]['seconds']} s")

    if "policies" in args.parts:
        partial = results["parts"].get("policies", {}).get("partial", {})

        def keep_partial(state: dict[str, Any]) -> None:
            results["parts"]["policies"] = {"partial": state}
            save()

        measured("policies", lambda: measure_policies(evaluation, runs, args.subset_share, partial, keep_partial))
    at_dtp_budget = [r for r in runs if r.family in ("off", "dtp") or r.label.endswith("@dtp budget")]
    if "irrelevant" in args.parts:
        measured("irrelevant", lambda: measure_irrelevant(evaluation, at_dtp_budget))
    if "deletion" in args.parts:
        chosen = [runs[0], runs[1], next(r for r in runs if r.label == "random @dtp budget")]
        measured("deletion", lambda: measure_deletion(evaluation, chosen, args.deletion_questions))
    return results


# --- the report -----------------------------------------------------------------------------------------


def interval(entry: dict[str, Any] | None, scale: float = 100, signed: bool = False) -> str:
    if not entry or entry.get("value") is None:
        return "—"
    low, high = entry["ci95"]
    sign = "+" if signed else ""
    return f"{scale * entry['value']:{sign}.1f} [{scale * low:{sign}.1f}, {scale * high:{sign}.1f}]"


def policies_section(results: dict[str, Any]) -> str:
    part = results.get("parts", {}).get("policies", {}).get("result")
    if not part:
        return "## Policies at equal tokens\n\nNot measured.\n"
    budgets = results.get("budgets", {})
    subset = part["privacy_subset"]
    rows = []
    for label, row in part["policies"].items():
        probe = row["digit_probe"]
        rows.append([label, f"{100 * row['kept_share']:.1f}%", interval(row["accuracy"]),
                     interval(row["loss_vs_off"], signed=True), percent(row["mark_sent_share"]["value"]),
                     interval(probe), interval(row["privacy_subset"]["accuracy"]),
                     percent(row["privacy_subset"]["mark_sent_share"]["value"])])
    return "\n".join([
        "## Policies at equal tokens",
        "",
        f"{part['questions']} test questions, one model (seed {results['key']['seed']}), pruning at inference only. "
        f"DTP's budget: {budgets.get('dtp_mean_kept', 0):.1f} of {budgets.get('num_patches')} tokens on average "
        f"(pruned share {budgets.get('dtp_ratio', 0):.3f}); every ratio policy at that budget keeps as many. "
        "Digit probe: logistic regression on the policy's own sent rows (mean and max pooled) of "
        f"{part['probe_images']['train']} training-split stamped images, tested on {part['probe_images']['test']} "
        f"(chance 10%). Privacy subset: {subset['images']} of {subset['of_images']} test images "
        f"({subset['questions']} questions, {subset['stamped_questions']} on stamped images), {subset['rule']}.",
        "",
        markdown_table(["policy", "kept", "accuracy % [95%]", "loss vs off, pts", "digit patches sent", "digit probe %",
                        "privacy subset accuracy %", "subset digit patches sent"], rows),
        "",
    ])


def irrelevant_section(results: dict[str, Any]) -> str:
    part = results.get("parts", {}).get("irrelevant", {}).get("result")
    if not part:
        return "## Irrelevant questions\n\nNot measured.\n"
    kinds = list(part["probes"])
    rows = []
    for label, row in part["policies"].items():
        cells = [label]
        for kind in kinds:
            cells += [interval(row[kind]["refusal"]), interval(row[kind]["hallucination"])]
        cells.append(interval(row["cross_image"].get("answerable_accuracy")))
        rows.append(cells)
    header = ["policy", *[f"{kind} {what} %" for kind in kinds for what in ("refusal", "hallucination")],
              "cross-image answerable accuracy %"]
    counts = ", ".join(f"{kind} {n}" for kind, n in part["probes"].items())
    return "\n".join([
        "## Irrelevant questions",
        "",
        f"Probes ({counts}); refusal and hallucination rates over the probes this image cannot answer.",
        "",
        markdown_table(header, rows),
        "",
    ])


def deletion_section(results: dict[str, Any]) -> str:
    part = results.get("parts", {}).get("deletion", {}).get("result")
    if not part:
        return "## Deletion by relevance\n\nNot measured.\n"
    shares = [0.0, *part["shares"]]
    rows = []
    for label, curves in part["policies"].items():
        for how, points in curves.items():
            rows.append([label, how.replace("_", " "), *[interval(p) for p in points]])
    return "\n".join([
        "## Deletion by relevance",
        "",
        f"{part['questions']} test questions: accuracy % [95%] as a share of the sent rows is deleted, the most "
        "relevant first (Chefer et al.'s relevance) or at random.",
        "",
        markdown_table(["policy", "deleted", *[f"{share:.0%}" for share in shares]], rows),
        "",
    ])


def render_report(results: dict[str, Any], folder: Path = RESULTS) -> Path:
    body = "\n".join([policies_section(results), irrelevant_section(results), deletion_section(results)])
    return write_markdown(NAME, "QPriv-VL's own evaluation on the scene testbed", body, results.get("provenance"),
                          command=COMMAND, folder=folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--dtp", type=Path, action="append", default=[], metavar="DIR",
                        help="a prepared DTP folder (one per α; the first sets the budget and the privacy subset)")
    parser.add_argument("--profile", default=PROFILE, help="mini-scenes (tiny: random weights, for tests)")
    parser.add_argument("--questions", type=int, default=1000, help="a seeded subset of the test questions")
    parser.add_argument("--probe-images", type=int, default=None, help="at most this many stamped images per split")
    parser.add_argument("--deletion-questions", type=int, default=300, help="questions of the deletion part")
    parser.add_argument("--subset-share", type=float, default=0.2, help="the privacy subset's share of test images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (the machine is shared)")
    parser.add_argument("--redo", action="store_true", help="measure every part again")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.report:
        print(render_report(read_json(NAME, args.out), args.out).read_text())
        return
    args.parts = tuple(part.strip() for part in args.parts.split(",") if part.strip())
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"--parts {','.join(unknown)}: not among {', '.join(PARTS)}")
    if not args.dtp:
        parser.error("--dtp: give at least one prepared DTP folder (qpriv-prune prepare --out DIR)")
    for folder in args.dtp:
        if not (folder / "prepare.json").is_file():
            parser.error(f"--dtp {folder}: no prepare.json there (qpriv-prune prepare --out {folder})")
    if not 0 < args.subset_share <= 1:
        parser.error(f"--subset-share {args.subset_share}: a share in (0, 1]")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    results = run(args)
    print(render_report(results, args.out).read_text())


if __name__ == "__main__":
    main()
