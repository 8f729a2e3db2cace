"""Memorisation on the scene testbed (issue 37 item 4): does undefended membership leak?

    python benchmarks/testbed_memorisation.py [--preset sims/sweeps/memorisation.toml] [--points 'memorisation-rows-128']
        [--fractions 0.25,0.5,1] [--processes 2] [--threads 1] [--out DIR] [--write [--results results/testbed.json]]

On easy-VQA nothing is memorised (loss-MIA AUC 0.53-0.62 in every run). The paper's 0.99 comes
from a small private set (VQA-RAD) fine-tuned for many epochs; sims/sweeps/memorisation.toml is
that setting on the scene testbed: undefended USL, one client holding `data.train_limit` rows,
one epoch per round. This script runs the preset's points in process (sims.inprocess, the
sweep's inprocess runner) and measures each at several epochs of one run: it runs the point
to a share of its rounds, replays `mia_loss` (attacks/mia.py, LossThresholdMIA: the target's
likelihood of the answer) on the client's fine-tuned model, then raises `train.rounds` and
resumes the same run (a resumable key), and so on to the point's own rounds. Members are the
client's training rows and non-members the test rows it scores on, never trained on
(attacks.truth.RunTruth.membership without canaries), as many of each (the attack's
`candidates` cap); with one client every member is a row of the attacked model's own data.
The epoch-0 row is the same attack on the untrained adapters (the public base): what the
membership signal is before any fine-tune.

Each point reports test accuracy (the run's own evaluation at that round), the loss-MIA AUC
and TPR at low FPR with the member and non-member counts, and at its last epochs the test
accuracy per question kind (answered again from the final model) and the accuracy on the
training rows; the top level holds the question-only baseline (per question text, the most
frequent answer of the public `train` split, falling back to the kind's) on the same test rows.

`measure_memorisation(...)` returns {"points": [...], "config": {...}, ...}; `--write` merges
it into results/testbed.json under "memorisation", keeping every other key
(benchmarks/testbed.py renders it; `testbed.py --parts memorisation` calls this too). Runs use
`threads` torch threads per process and at most `processes` processes, one point each.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
if str(REPOSITORY) not in sys.path:
    sys.path.insert(0, str(REPOSITORY))

PRESET = REPOSITORY / "sims" / "sweeps" / "memorisation.toml"
RESULTS_FILE = REPOSITORY / "results" / "testbed.json"
KEY = "memorisation"
ATTACK = "mia_loss"
# The acceptance target (issue 37 item 4): undefended loss-MIA AUC on training rows vs held-out rows.
TARGET_AUC = 0.9
DEFAULT_FRACTIONS = (0.25, 0.5, 1.0)
BASELINE_SPLIT = "train"
# What the preset varies between its points.
POINT_KEYS = ("data.train_limit", "train.steps_per_round", "train.rounds")


# --- bookkeeping -------------------------------------------------------------------------------


def checkpoint_rounds(rounds: int, fractions: Iterable[float]) -> list[int]:
    """The rounds a point is measured at: each share of its rounds (at least round 1), ascending,
    always ending at `rounds` itself."""
    picked = {max(1, min(rounds, round(rounds * float(f)))) for f in fractions if float(f) > 0}
    return sorted(picked | {rounds})


def epochs_of(steps: int, batch_size: int, rows: int) -> float:
    """Epochs over a client's `rows` after `steps` optimiser steps of `batch_size` samples."""
    return steps * batch_size / rows if rows else 0.0


def question_only_accuracy(train: Sequence[Any], test: Sequence[Any]) -> dict[str, Any]:
    """The question-only baseline on `test`: per question text the most frequent answer in
    `train` (a text never seen: its kind's most frequent answer), scored as the runs score
    (vqa.aggregate_accuracy), overall and per question kind (vqa.BASELINE_RULE)."""
    from vqa import aggregate_accuracy, question_only_predictions

    predictions, _ = question_only_predictions(train, test)
    report = aggregate_accuracy(predictions, list(test))
    return {"accuracy": report.overall.accuracy, "count": report.overall.count,
            "by_kind": {kind: {"accuracy": g.accuracy, "count": g.count} for kind, g in report.by_question_kind.items()}}


def merge_results(path: str | Path, key: str, value: Any) -> Path:
    """Set `key` in the JSON object at `path` (created if missing), keeping every other key;
    written whole to a temporary file first, so a reader never sees it torn."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; not merging into it")
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    os.replace(temporary, path)
    return path


# --- one point -----------------------------------------------------------------------------------


def _metrics_at(folder: Path, round_: int) -> dict[str, Any]:
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("round") == round_:
            return record
    return {}


def _committed_round(folder: Path) -> int:
    committed = folder / "committed.json"
    return json.loads(committed.read_text())["round"] if committed.is_file() else 0


def _mia_row(result: Any) -> dict[str, Any]:
    """The attack's metrics, with the AUC's 95% interval: a bootstrap over the scored rows."""
    from analysis.stats import bootstrap_auroc

    metrics = result.metrics
    scores = result.outputs["scores"].numpy()[:, None]
    labels = result.outputs["is_member"].numpy().astype(int)[:, None]
    auc = bootstrap_auroc(scores, labels)
    return {"mia_auc": metrics.get("auc"), "mia_auc_low": auc.low, "mia_auc_high": auc.high,
            "mia_tpr_at_fpr_0.01": metrics.get("tpr_at_fpr_0.01"),
            "mia_tpr_at_fpr_0.001": metrics.get("tpr_at_fpr_0.001"), "mia_attack_success": metrics.get("attack_success"),
            "members": result.details.get("members"), "non_members": result.details.get("non_members")}


def _answer_accuracy(knowledge: Any, model: Any, samples: Sequence[Any], batch_size: int, max_new_tokens: int
                     ) -> dict[str, Any]:
    """`model`'s greedy answers to `samples` scored overall and per question kind."""
    from vlm.answering import answer_questions
    from vlm.features import VisionFeatureCache
    from vqa import aggregate_accuracy

    features = VisionFeatureCache(model, knowledge.preprocess_images)
    features.add(samples, progress=False)
    predictions = answer_questions(model, knowledge.tokenizer, features, list(samples), instruction=knowledge.instruction,
                                   batch_size=batch_size, max_new_tokens=max_new_tokens, progress=False)
    report = aggregate_accuracy(predictions, list(samples))
    return {"accuracy": report.overall.accuracy, "count": report.overall.count,
            "by_kind": {kind: {"accuracy": g.accuracy, "count": g.count} for kind, g in report.by_question_kind.items()}}


def measure_point(sim: str, name: str, overrides: Mapping[str, Any], checkpoints: Sequence[int], *,
                  mia_options: Mapping[str, Any], threads: int = 1, evaluate: bool = True,
                  log: bool = True) -> dict[str, Any]:
    """One point of the preset measured at each of `checkpoints` (rounds, ascending) of one run,
    and at epoch 0 (the untrained adapters). Runs in this process with `threads` torch threads."""
    import torch

    torch.set_num_threads(threads)
    from attacks.context import ReplayContext, final_model
    from attacks.replay import fit_for_run, replay
    from attacks.truth import RunTruth
    from config import load_config
    from sims.inprocess import run_in_process
    from sims.launch import app_config

    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    config = load_config(app_config(sim, dict(overrides)))
    folder = config.run_folder()
    fitted = None
    skipped: list[int] = []
    base: dict[str, Any] = {}
    truth = members = None
    train_rows = 0
    # Each row as it is measured, beside the runs (a killed measurement keeps what it finished).
    partial = folder.parent.parent / "curve" / f"{name}.json"

    def say(text: str) -> None:
        if log:
            print(f"[{name}] {text}", flush=True)

    def keep_partial() -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(rows, indent=2, default=str))

    def measure_checkpoints() -> None:
        nonlocal fitted, base, config, truth, members, train_rows
        for rounds in checkpoints:
            if _committed_round(folder) > rounds:
                skipped.append(rounds)
                say(f"round {rounds}: the run in {folder} is already past it; not measured")
                continue
            clock = time.perf_counter()
            run_in_process(app_config(sim, {**overrides, "train.rounds": rounds}))
            status = json.loads((folder / "status.json").read_text())
            if status.get("state") != "finished":
                raise RuntimeError(f"point {name}: run {status.get('state')} at round {rounds}: {status.get('error')}")
            train_seconds = time.perf_counter() - clock
            config = load_config(json.loads((folder / "config.json").read_text())["config"])
            if fitted is None:
                fitted = fit_for_run(folder, ATTACK, options={"progress": False, **mia_options})
                truth = RunTruth.from_run_folder(folder)
                members, _ = truth.membership()
                train_rows = len(members)
                # Epoch 0: the same attack on the untrained adapters (the public base model).
                fitted.set_target(fitted.knowledge.model)
                base = _mia_row(fitted.run(None, truth))
                if evaluate:
                    base_eval = _answer_accuracy(fitted.knowledge, fitted.knowledge.model, list(truth.data.test_all),
                                                 config.eval.batch_size, config.eval.max_new_tokens)
                    base.update(test_accuracy=base_eval["accuracy"], test_count=base_eval["count"],
                                test_accuracy_by_kind=base_eval["by_kind"])
                rows.append({"point": name, "train_rows": train_rows, "rounds": 0, "steps": 0, "epochs": 0.0, **base})
                keep_partial()
                say(f"epoch 0: AUC {base['mia_auc']:.3f}")
            clock = time.perf_counter()
            result = replay(folder, fitted, save=False)
            mia_seconds = time.perf_counter() - clock
            metrics = _metrics_at(folder, rounds)
            steps = rounds * config.train.steps_per_round
            row = {"point": name, "train_rows": train_rows, "rounds": rounds, "steps": steps,
                   "epochs": epochs_of(steps, config.train.batch_size, train_rows),
                   "test_accuracy": metrics.get("test_accuracy"), "test_count": metrics.get("test_count"),
                   "train_loss": metrics.get("train_loss"), **_mia_row(result),
                   "train_seconds": round(train_seconds, 1), "mia_seconds": round(mia_seconds, 1)}
            if rounds == checkpoints[-1]:
                # The last epochs: saved where the sweep finds its mia_loss result, so
                # `qpriv-sweep run` on the preset's folder does not replay it again.
                result.attack = ATTACK
                result.details.update(base_attack=ATTACK, options=dict(mia_options))
                result.save(folder / "attacks")
                if evaluate:
                    model = final_model(ReplayContext(folder, config, fitted.knowledge, 0))
                    test = _answer_accuracy(fitted.knowledge, model, list(truth.data.test_all), config.eval.batch_size,
                                            config.eval.max_new_tokens)
                    train = _answer_accuracy(fitted.knowledge, model, members, config.eval.batch_size,
                                             config.eval.max_new_tokens)
                    row.update(train_accuracy=train["accuracy"], test_accuracy_by_kind=test["by_kind"],
                               train_accuracy_by_kind=train["by_kind"])
            rows.append(row)
            keep_partial()
            say(f"round {rounds} ({row['epochs']:g} epochs): test accuracy {row['test_accuracy']}, "
                f"AUC {row['mia_auc']:.3f} ({row['members']} members, {row['non_members']} non-members), "
                f"{train_seconds:.0f} s training")

    error = None
    try:
        measure_checkpoints()
    except Exception as failure:  # noqa: BLE001 - a failed point keeps the rows it measured; the others go on
        error = f"{type(failure).__name__}: {failure}"
        say(f"failed: {error}")
    return {"point": name, "rows": rows, "skipped_rounds": skipped, "seconds": round(time.perf_counter() - started, 1),
            "run_folder": str(folder), **({"error": error} if error else {})}


def _measure_point_job(arguments: dict[str, Any]) -> dict[str, Any]:
    return measure_point(**arguments)


# --- the curve -----------------------------------------------------------------------------------


def measure_memorisation(
    preset: str | Path = PRESET,
    *,
    profile: str | None = None,
    seed: int | None = None,
    points: Sequence[str] | None = None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    overrides: Mapping[str, Any] | None = None,
    out: str | Path | None = None,
    processes: int = 2,
    threads: int = 1,
    evaluate: bool = True,
    progress: bool = True,
    allow_dirty: bool = False,
) -> dict[str, Any]:
    """The preset's points (those matching a pattern in `points`; default all) measured at
    `fractions` of their rounds and at epoch 0. `profile` and `seed` override model.profile and
    data.seed/model.seed of every point, `overrides` any other run-config key. Runs go to `out`
    (default: the sweep's own folder, ~/qpriv-sweeps/<preset stem>[-<profile>][-seed<seed>]).
    A working tree whose code is not its commit's raises DirtyTree before anything runs, unless
    `allow_dirty`. Returns {"points": rows (one per point and epoch), "config": the fixed settings, ...}."""
    from analysis.provenance import of_runs, provenance
    from sims.sweep import load_sweep

    preset = Path(preset)
    suffix = (f"-{profile}" if profile else "") + (f"-seed{seed}" if seed else "")
    folder = Path(out).expanduser() if out else Path.home() / "qpriv-sweeps" / f"{preset.stem}{suffix}"
    sweep = load_sweep(preset, runner="inprocess", out=folder)
    chosen = [p for p in sweep.points if not points or any(fnmatch.fnmatchcase(p.name, pattern) for pattern in points)]
    if not chosen:
        raise ValueError(f"no point of {preset} matches {list(points or [])}")
    plan = next((a for a in sweep.attacks if a.attack == ATTACK), None)
    mia_options = dict(plan.options) if plan is not None else {}
    extra = dict(overrides or {})
    if profile:
        extra["model.profile"] = profile
    if seed:
        extra.update({"data.seed": seed, "model.seed": seed})
    jobs = []
    for point in chosen:
        point_overrides = {**point.overrides, **extra}
        jobs.append({"sim": str(sweep.sim), "name": point.name, "overrides": point_overrides,
                     "checkpoints": checkpoint_rounds(int(point_overrides.get("train.rounds", point.config.train.rounds)),
                                                      fractions),
                     "mia_options": mia_options, "threads": threads, "evaluate": evaluate, "log": progress})
    stamp = provenance(allow_dirty=allow_dirty, **of_runs({**point.config.to_flat(), **extra} for point in chosen))
    started = time.perf_counter()
    load_before = os.getloadavg()
    if processes <= 1 or len(jobs) == 1:
        outcomes = [measure_point(**job) for job in jobs]
    else:
        # The longest runs first, so that the last to start is a short one; results in the preset's order.
        cost = {job["name"]: int(job["overrides"].get("train.rounds", 1)) * int(job["overrides"].get("train.steps_per_round", 1))
                for job in jobs}
        ordered = sorted(jobs, key=lambda job: -cost[job["name"]])
        # Spawned workers start clean (no inherited torch thread pools); each reads the thread cap.
        saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ.update({name: str(threads) for name in saved})
        try:
            with ProcessPoolExecutor(max_workers=min(processes, len(jobs)), mp_context=get_context("spawn")) as pool:
                by_name = dict(zip([job["name"] for job in ordered], pool.map(_measure_point_job, ordered), strict=True))
            outcomes = [by_name[job["name"]] for job in jobs]
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    wall = time.perf_counter() - started
    from config import load_config
    from sims.launch import app_config
    from vqa import load_vqa

    resolved = load_config(app_config(sweep.sim, jobs[0]["overrides"]))
    data = resolved.data
    test_rows = load_vqa(data.dataset, data.test_split, data.source or None, limit=data.test_limit or None, seed=data.seed)
    baseline = question_only_accuracy(load_vqa(data.dataset, BASELINE_SPLIT, data.source or None), test_rows)
    rows = [row for outcome in outcomes for row in outcome["rows"]]
    final = [outcome["rows"][-1] for outcome in outcomes if outcome["rows"]]
    fixed_keys = ("paradigm", "model.profile", "model.stage", "model.lora_rank", "data.dataset", "data.train_split",
                  "data.test_split", "data.test_limit", "clients.count", "train.batch_size", "train.lr",
                  "threat.model", "privacy.defenses", "pruning.policy")
    flat = resolved.to_flat()
    return {
        "points": rows,
        "target_auc": TARGET_AUC,
        "reached_target": any((row.get("mia_auc") or 0) >= TARGET_AUC and (row.get("test_accuracy") or 0)
                              > baseline["accuracy"] for row in rows if row["epochs"] > 0),
        "best_auc": max((row.get("mia_auc") or 0.0) for row in final) if final else None,
        "question_only_accuracy": baseline["accuracy"],
        "question_only_by_kind": baseline["by_kind"],
        "question_only_rule": f"per question text, the most frequent answer of {data.dataset}/{BASELINE_SPLIT} "
                              "(an unseen text: its kind's most frequent answer), on the runs' test rows",
        "config": {"preset": str(preset), "sim": str(sweep.sim), "sweep_folder": str(folder),
                   "attack": ATTACK, "attack_options": mia_options, "fractions": list(fractions),
                   "processes": processes, "torch_threads": threads,
                   **{key: flat.get(key) for key in fixed_keys},
                   "points": {job["name"]: {key: job["overrides"].get(key) for key in POINT_KEYS} for job in jobs}},
        "runs": [{k: v for k, v in outcome.items() if k != "rows"} for outcome in outcomes],
        "wall_seconds": round(wall, 1),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "provenance": stamp,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    from analysis.provenance import DirtyTree

    sys.path.insert(0, str(Path(__file__).parent))
    from report import add_allow_dirty

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", type=Path, default=PRESET, help="the sweep file whose points are measured")
    parser.add_argument("--points", action="append", metavar="PATTERN", help="only the points matching this pattern")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                        help="the shares of each point's rounds it is measured at (its last always)")
    parser.add_argument("--profile", help="model.profile of every point (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="data.seed and model.seed of every point (0: the preset's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another run-config override of every point (a TOML value); repeatable")
    parser.add_argument("--out", type=Path, help="the sweep folder (default ~/qpriv-sweeps/<preset stem>)")
    parser.add_argument("--processes", type=int, default=2, help="points measured at once, one process each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--no-evaluate", action="store_true", help="skip the per-kind and training-row answers")
    parser.add_argument("--write", action="store_true", help=f"merge the result into --results under {KEY!r}")
    parser.add_argument("--results", type=Path, default=RESULTS_FILE, help="the JSON --write merges into")
    parser.add_argument("--json", type=Path, help="also write the result alone to this file")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.processes < 1 or args.threads < 1:
        parser.error("--processes and --threads must be at least 1")
    from sims.launch import parse_overrides

    try:
        result = measure_memorisation(
            args.preset, profile=args.profile, seed=args.seed, points=args.points,
            fractions=[float(f) for f in args.fractions.split(",") if f.strip()],
            overrides=parse_overrides(args.set) if args.set else None, out=args.out,
            processes=args.processes, threads=args.threads, evaluate=not args.no_evaluate,
            allow_dirty=args.allow_dirty)
    except DirtyTree as error:
        print(f"testbed_memorisation: {error}", file=sys.stderr)
        return 2
    for row in result["points"]:
        print(f"{row['point']}: {row['train_rows']} rows, {row['epochs']:g} epochs: test accuracy "
              f"{row.get('test_accuracy')}, AUC {row.get('mia_auc'):.3f} ({row.get('members')}/{row.get('non_members')})")
    print(f"question-only baseline {result['question_only_accuracy']:.3f}; reached AUC >= {TARGET_AUC} above it: "
          f"{result['reached_target']}; {result['wall_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.write:
        print(f"merged into {merge_results(args.results, KEY, result)} under {KEY!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
