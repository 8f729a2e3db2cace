"""Memorisation on the scene testbed (issue 37 item 4): does undefended membership leak?

    python benchmarks/testbed_memorisation.py [--preset sims/sweeps/memorisation.toml] [--points 'memorisation-rows-128']
        [--seeds 0,1,2] [--fractions 0.25,0.5,1] [--processes 2] [--threads 1] [--out DIR]
        [--write [--results results/testbed.json]]

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

Which rows one run memorises, and how well, varies with the seed (rows-16: AUC 0.95 at one seed,
0.79 at another), so each point runs at every seed of `--seeds` (0: the preset's own seeds;
k: data.seed = model.seed = k, in the sweep folder <preset stem>-seed<k>), and the acceptance
reads the mean over seeds of the AUC at a point's last epochs ("across_seeds"), with a 95%
bootstrap interval over the seeds (over the scored rows when one seed ran).

`measure_memorisation(...)` returns {"points": [...], "across_seeds": [...], "config": {...}, ...};
`--write` merges it into results/testbed.json under "memorisation", keeping every other key and
the rows of every (point, seed) not measured this time, the summary taken again over all of them
(benchmarks/testbed.py renders it; `testbed.py --parts memorisation` calls this too). Runs use
`threads` torch threads per process and at most `processes` processes, one (point, seed) each.
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

import numpy as np

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
POINT_KEYS = ("data.train_limit", "data.question_kinds", "train.batch_size", "train.steps_per_round", "train.rounds")


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
                  mia_options: Mapping[str, Any], seed: int = 0, threads: int = 1, evaluate: bool = True,
                  log: bool = True) -> dict[str, Any]:
    """One point of the preset at one seed (its rows say which; `overrides` set it) measured at each
    of `checkpoints` (rounds, ascending) of one run, and at epoch 0 (the untrained adapters). A round
    the run is already past cannot be measured again: its row comes back from the curve file an
    earlier measurement of the run left, if any. Runs in this process with `threads` torch threads."""
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
    recorded = {row["rounds"]: row for row in (json.loads(partial.read_text()) if partial.is_file() else [])}

    def say(text: str) -> None:
        if log:
            print(f"[{name} seed {seed}] {text}", flush=True)

    def keep_partial() -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(rows, indent=2, default=str))

    def measure_checkpoints() -> None:
        nonlocal fitted, base, config, truth, members, train_rows
        for rounds in checkpoints:
            if _committed_round(folder) > rounds:
                skipped.append(rounds)
                if rounds in recorded:
                    rows.append({**recorded[rounds], "seed": seed})
                say(f"round {rounds}: the run in {folder} is already past it; "
                    + ("its recorded row kept" if rounds in recorded else "not measured"))
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
                rows.append({"point": name, "seed": seed, "train_rows": train_rows, "rounds": 0, "steps": 0,
                             "epochs": 0.0, **base})
                keep_partial()
                say(f"epoch 0: AUC {base['mia_auc']:.3f}")
            clock = time.perf_counter()
            result = replay(folder, fitted, save=False)
            mia_seconds = time.perf_counter() - clock
            metrics = _metrics_at(folder, rounds)
            steps = rounds * config.train.steps_per_round
            row = {"point": name, "seed": seed, "train_rows": train_rows, "rounds": rounds, "steps": steps,
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
    rows.sort(key=lambda row: row["rounds"])
    return {"point": name, "seed": seed, "rows": rows, "skipped_rounds": skipped,
            "seconds": round(time.perf_counter() - started, 1),
            "run_folder": str(folder), **({"error": error} if error else {})}


def _measure_point_job(arguments: dict[str, Any]) -> dict[str, Any]:
    return measure_point(**arguments)


# --- the curve -----------------------------------------------------------------------------------


def seed_folder(base: Path, seed: int) -> Path:
    """The sweep folder of the runs at `seed`: `base` itself at 0 (the preset's own seeds), else
    <base>-seed<seed>."""
    return base.with_name(f"{base.name}-seed{seed}") if seed else base


def measure_memorisation(
    preset: str | Path = PRESET,
    *,
    profile: str | None = None,
    seeds: Sequence[int] = (0,),
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
    """The preset's points (those matching a pattern in `points`; default all) at each of `seeds`,
    measured at `fractions` of their rounds and at epoch 0. `profile` overrides model.profile of
    every point, a seed k > 0 data.seed and model.seed, `overrides` any other run-config key. Runs
    go to one sweep folder a seed, seed_folder() of `out` (default ~/qpriv-sweeps/<preset stem>
    [-<profile>]). A working
    tree whose code is not its commit's raises DirtyTree before anything runs, unless `allow_dirty`.
    Returns {"points": rows (one per point, seed and epoch), "across_seeds": summarise()'s, ...}."""
    from analysis.provenance import of_runs, provenance
    from sims.sweep import load_sweep

    preset = Path(preset)
    seeds = sorted({int(seed) for seed in seeds})
    if not seeds or seeds[0] < 0:
        raise ValueError(f"seeds={list(seeds)}: give one or more seeds >= 0 (0: the preset's own)")
    plan = None
    jobs, configs = [], []
    base = Path(out).expanduser() if out else Path.home() / "qpriv-sweeps" / (preset.stem + (f"-{profile}" if profile else ""))
    for seed in seeds:
        extra = dict(overrides or {})
        if profile:
            extra["model.profile"] = profile
        if seed:
            extra.update({"data.seed": seed, "model.seed": seed})
        sweep = load_sweep(preset, runner="inprocess", out=seed_folder(base, seed), overrides=extra)
        chosen = [p for p in sweep.points if not points or any(fnmatch.fnmatchcase(p.name, pattern) for pattern in points)]
        if not chosen:
            raise ValueError(f"no point of {preset} matches {list(points or [])}")
        plan = next((a for a in sweep.attacks if a.attack == ATTACK), None)
        for point in chosen:
            jobs.append({"sim": str(sweep.sim), "name": point.name, "seed": seed, "overrides": point.overrides,
                         "checkpoints": checkpoint_rounds(point.config.train.rounds, fractions),
                         "threads": threads, "evaluate": evaluate, "log": progress})
            configs.append(point.config.to_flat())
    mia_options = dict(plan.options) if plan is not None else {}
    for job in jobs:
        job["mia_options"] = mia_options
    stamp = provenance(allow_dirty=allow_dirty, **of_runs(configs))
    started = time.perf_counter()
    load_before = os.getloadavg()
    if processes <= 1 or len(jobs) == 1:
        outcomes = [measure_point(**job) for job in jobs]
    else:
        # The longest runs first, so that the last to start is a short one; results in the preset's order.
        def cost(job: dict[str, Any]) -> int:
            return int(job["overrides"].get("train.rounds", 1)) * int(job["overrides"].get("train.steps_per_round", 1))

        ordered = sorted(range(len(jobs)), key=lambda i: -cost(jobs[i]))
        # Spawned workers start clean (no inherited torch thread pools); each reads the thread cap.
        saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ.update({name: str(threads) for name in saved})
        try:
            with ProcessPoolExecutor(max_workers=min(processes, len(jobs)), mp_context=get_context("spawn")) as pool:
                by_index = dict(zip(ordered, pool.map(_measure_point_job, [jobs[i] for i in ordered]), strict=True))
            outcomes = [by_index[i] for i in range(len(jobs))]
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

    # The test rows a run scores on are drawn with its data.seed (and its data.question_kinds): a
    # baseline for each, carried by the rows it is the baseline of.
    by_rows: dict[tuple[int, tuple[str, ...]], dict[str, Any]] = {}
    for job, outcome in zip(jobs, outcomes, strict=True):
        data = load_config(app_config(job["sim"], job["overrides"])).data
        key = (job["seed"], data.kinds)
        if key not in by_rows:
            test_rows = load_vqa(data.dataset, data.test_split, data.source or None, limit=data.test_limit or None,
                                 seed=data.seed, question_kinds=data.kinds)
            by_rows[key] = question_only_accuracy(load_vqa(data.dataset, BASELINE_SPLIT, data.source or None), test_rows)
        for row in outcome["rows"]:
            row["question_only_accuracy"] = by_rows[key]["accuracy"]
    baselines = {seed: baseline for (seed, kinds), baseline in by_rows.items() if not kinds}
    resolved = load_config(app_config(jobs[0]["sim"], jobs[0]["overrides"]))
    fixed_keys = ("paradigm", "model.profile", "model.stage", "model.lora_rank", "data.dataset", "data.train_split",
                  "data.test_split", "data.test_limit", "clients.count", "train.lr",
                  "threat.model", "privacy.defenses", "pruning.policy")
    flat = resolved.to_flat()
    rows = [row for outcome in outcomes for row in outcome["rows"]]
    return {
        "points": rows,
        **summarise(rows, {seed: baseline["accuracy"] for seed, baseline in baselines.items()}),
        "question_only_by_kind": next(iter(by_rows.values()))["by_kind"],
        "question_only_rule": f"per question text, the most frequent answer of {resolved.data.dataset}/{BASELINE_SPLIT} "
                              "(an unseen text: its kind's most frequent answer), on each run's own test rows (drawn "
                              "with its data.seed, of its data.question_kinds); by kind on the first run's",
        "config": {"preset": str(preset), "sim": jobs[0]["sim"],
                   "attack": ATTACK, "attack_options": mia_options, "fractions": list(fractions),
                   "processes": processes, "torch_threads": threads,
                   **{key: flat.get(key) for key in fixed_keys},
                   "points": {job["name"]: {key: job["overrides"][key] for key in POINT_KEYS if key in job["overrides"]}
                              for job in jobs}},
        "runs": [{k: v for k, v in outcome.items() if k != "rows"} for outcome in outcomes],
        "wall_seconds": round(wall, 1),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "provenance": stamp,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def summarise(rows: Sequence[Mapping[str, Any]], baselines: Mapping[int, float]) -> dict[str, Any]:
    """Each point's last epochs across its seeds, and the acceptance read from them.

    `rows` are measure_point's (a row without a seed is seed 0's), each with the question-only
    accuracy of its own test rows; `baselines`, the question-only accuracy on every kind's test
    rows by seed, stands in for a row written before rows carried theirs. A point's entry holds,
    from each seed's row at the most epochs, the AUC by seed and their mean with a 95% interval
    (a bootstrap over the seeds, analysis.stats.bootstrap; with one seed, the row's own bootstrap
    over the scored rows), and the mean test accuracy against the mean of those seeds' baselines. The target is reached by a point whose mean AUC is
    at least TARGET_AUC while its mean test accuracy beats its baseline."""
    from analysis.stats import bootstrap

    last: dict[str, dict[int, Mapping[str, Any]]] = {}
    for row in rows:
        seed = int(row.get("seed", 0))
        kept = last.setdefault(row["point"], {}).get(seed)
        if row.get("epochs") and (kept is None or row["epochs"] > kept["epochs"]):
            last[row["point"]][seed] = row
    across = []
    for point, by_seed in last.items():
        seeds = sorted(by_seed)
        aucs = [float(by_seed[seed]["mia_auc"]) for seed in seeds]
        if len(seeds) > 1:
            estimate = bootstrap([np.array([auc]) for auc in aucs])
            low, high = estimate.low, estimate.high
        else:
            low, high = by_seed[seeds[0]].get("mia_auc_low"), by_seed[seeds[0]].get("mia_auc_high")
        accuracy = [by_seed[seed].get("test_accuracy") for seed in seeds]
        own_baselines = [by_seed[seed].get("question_only_accuracy", baselines.get(seed)) for seed in seeds]
        members = sorted({int(by_seed[seed].get("members") or 0) for seed in seeds})
        across.append({
            "point": point, "train_rows": by_seed[seeds[0]].get("train_rows"),
            "epochs": min(by_seed[seed]["epochs"] for seed in seeds), "seeds": seeds,
            "mia_auc": float(np.mean(aucs)), "mia_auc_low": low, "mia_auc_high": high,
            "mia_auc_by_seed": aucs,
            "test_accuracy": float(np.mean(accuracy)) if None not in accuracy else None,
            "question_only_accuracy": float(np.mean(own_baselines)) if None not in own_baselines else None,
            "n": f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} × "
                 + (f"{members[0]}" if len(members) == 1 else "/".join(map(str, members))) + " members a side",
        })

    def beats_baseline(entry: Mapping[str, Any]) -> bool:
        return None not in (entry["test_accuracy"], entry["question_only_accuracy"]) and (
            entry["test_accuracy"] > entry["question_only_accuracy"])

    across.sort(key=lambda entry: (entry["train_rows"] is None, entry["train_rows"] or 0, entry["point"]))
    eligible = [entry for entry in across if beats_baseline(entry)]
    best = max(eligible, key=lambda entry: entry["mia_auc"], default=None)
    return {
        "across_seeds": across,
        "target_auc": TARGET_AUC,
        "best_point": best["point"] if best else None,
        "best_auc": best["mia_auc"] if best else None,
        "reached_target": bool(best and best["mia_auc"] >= TARGET_AUC),
        "question_only_accuracy": float(np.mean(list(baselines.values()))) if baselines else None,
        "question_only_by_seed": {str(seed): value for seed, value in sorted(baselines.items())},
    }


def combine(earlier: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """`result` over an `earlier` measurement: the rows of every (point, seed) it did not measure and
    the baselines of every seed it did not run are kept, and the summary is taken again over all."""
    measured = {(row["point"], int(row.get("seed", 0))) for row in result["points"]}
    # A row written before rows carried their seed is seed 0's (the preset's own).
    rows = [{**row, "seed": int(row.get("seed", 0))} for row in earlier.get("points", [])
            if (row["point"], int(row.get("seed", 0))) not in measured]
    rows += list(result["points"])
    baselines = {int(seed): value for seed, value in earlier.get("question_only_by_seed", {}).items()}
    baselines.update({int(seed): value for seed, value in result["question_only_by_seed"].items()})
    points = {**earlier.get("config", {}).get("points", {}), **result["config"]["points"]}
    return {**result, "points": rows, **summarise(rows, baselines), "config": {**result["config"], "points": points}}


def merge_measurement(path: str | Path, result: Mapping[str, Any]) -> Path:
    """--write: `result` combined with what `path` holds under KEY, written back, every other key kept."""
    path = Path(path)
    earlier = json.loads(path.read_text()).get(KEY, {}) if path.is_file() else {}
    return merge_results(path, KEY, combine(earlier, result))


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
    parser.add_argument("--seeds", default="0", help="comma-separated seeds each point runs at: data.seed and "
                        "model.seed (0: the preset's own), each in its own sweep folder")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another run-config override of every point (a TOML value); repeatable")
    parser.add_argument("--out", type=Path, help="the sweep folder at seed 0, <out>-seed<k> at seed k "
                        "(default ~/qpriv-sweeps/<preset stem>)")
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
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: comma-separated integers >= 0 expected")
    from sims.launch import parse_overrides

    try:
        result = measure_memorisation(
            args.preset, profile=args.profile, seeds=seeds, points=args.points,
            fractions=[float(f) for f in args.fractions.split(",") if f.strip()],
            overrides=parse_overrides(args.set) if args.set else None, out=args.out,
            processes=args.processes, threads=args.threads, evaluate=not args.no_evaluate,
            allow_dirty=args.allow_dirty)
    except (DirtyTree, ValueError) as error:
        print(f"testbed_memorisation: {error}", file=sys.stderr)
        return 2
    for row in result["points"]:
        print(f"{row['point']} seed {row['seed']}: {row['train_rows']} rows, {row['epochs']:g} epochs: test accuracy "
              f"{row.get('test_accuracy')}, AUC {row.get('mia_auc'):.3f} ({row.get('members')}/{row.get('non_members')})")
    for entry in result["across_seeds"]:
        print(f"{entry['point']}, {entry['epochs']:g} epochs, seeds {entry['seeds']}: mean AUC {entry['mia_auc']:.3f} "
              f"[{entry['mia_auc_low']:.3f}, {entry['mia_auc_high']:.3f}], test accuracy {entry['test_accuracy']} "
              f"(question-only {entry['question_only_accuracy']})")
    print(f"reached mean AUC >= {TARGET_AUC} above the question-only baseline: {result['reached_target']}; "
          f"{result['wall_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.write:
        print(f"merged into {merge_measurement(args.results, result)} under {KEY!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
