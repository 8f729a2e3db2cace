"""The shipped mini sweeps' tables, from their run folders, as results/<name>.md.

    qpriv-sweep run sims/sweeps/paradigms.toml && python benchmarks/sweep_results.py paradigms
    qpriv-sweep run sims/sweeps/pruning-attacks.toml && python benchmarks/sweep_results.py pruning-attacks
    qpriv-sweep run sims/sweeps/defenses.toml && python benchmarks/sweep_results.py defenses
    qpriv-sweep run sims/sweeps/vision-edge.toml && python benchmarks/sweep_results.py vision-edge
    qpriv-sweep run sims/sweeps/federated-privacy.toml && python benchmarks/sweep_results.py federated-privacy
    qpriv-sweep run sims/sweeps/dpmtv.toml && python benchmarks/sweep_results.py dpmtv
    qpriv-sweep run sims/sweeps/cross-device.toml && python benchmarks/sweep_results.py cross-device
    python benchmarks/sweep_results.py pruning-attacks --report      # re-render the markdown only

Reads the sweep folder (--sweep; default ~/qpriv-sweeps/<name>, else the sweep's archive in
results/sweeps/<name>, which `qpriv-sweep run --archive` keeps: sims/archive.py) through the
analysis package the results notebook draws from, so the notebook's tables and these are the same
numbers; each paper's claims are judged by analysis.claims (paired intervals over seeds, a declared
margin, and "not testable" with why). Writes results/<name>.json (the tables, the sweep's time per run and attack, and the
provenance the sweep stamped when it started: the commit its runs were made with) and renders
results/<name>.md from it.
"""

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import runs, tables as T
from analysis.claims import activation_inversion, dp_mtv, qpriv_vl, vision_edge
from analysis.provenance import merge
from attacks.base import ATTACKS
from training.protocol import SWEEP_STAMP

from report import REPORT_HELP, RESULTS, markdown_table, percent, read_json, write_json, write_markdown

# Sweeps whose runs join another's report: pruning-mia measures membership through each policy, and
# memorisation-audit audits DP-SGD with input-space canaries where membership leaks.
COMPANIONS = {"pruning-attacks": ("pruning-mia",), "federated-privacy": ("memorisation-audit",)}
SWEEPS = ("paradigms", "pruning-attacks", "defenses", "vision-edge", "federated-privacy", "dpmtv", "cross-device")
COMMAND = "python benchmarks/sweep_results.py"


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return json.loads(frame.to_json(orient="records")) if not frame.empty else []


def sweep_seconds(folder: Path) -> dict[str, Any]:
    """Seconds per point (its run and each attack) from the sweep's point records, and the total."""
    per_point = {}
    for path in sorted((folder / "points").glob("*.json")):
        record = json.loads(path.read_text())
        per_point[path.stem] = {"run": record.get("run", {}).get("seconds"),
                                **{name: a.get("seconds") for name, a in record.get("attacks", {}).items()}}
    total = sum(v for point in per_point.values() for v in point.values() if v is not None)
    return {"per_point": per_point, "total_s": total}


def measure(name: str, folder: Path, companions: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The sweep's tables; `companions` (other sweeps' folders) join only its claims: the membership
    of each policy is measured in the memorisation setting, pruning-mia, not in the pruning sweep."""
    results = runs.load_results(folder)
    stamp = json.loads((folder / SWEEP_STAMP).read_text())
    tables: dict[str, Any] = {"incomplete": records(results.incomplete)}
    if name == "paradigms":
        tables["paradigms"] = records(T.paradigm_table(results))
        per_round = results.rounds.merge(results.runs[["run", "paradigm"]], on="run")
        tables["rounds"] = records(per_round[["paradigm", "round", "test_accuracy", "train_loss"]])
    elif name == "defenses":
        tables["defenses"] = records(T.defense_table(results))
        tables["defense_claims"] = {p: records(activation_inversion.claims(results, p))
                                    for p in sorted(set(results.attacks["paradigm"]))} if not results.attacks.empty else {}
    elif name == "vision-edge":
        tables["edge"] = records(T.image_attack_table(results))
        puri = T.puri_table(results)
        tables["puri"], tables["best_puri"] = records(puri), records(T.best_by_puri(puri))
        tables["seed_spread"] = records(T.seed_spread(results))
        tables["edge_claims"] = {p: records(vision_edge.claims(results, p))
                                 for p in sorted(set(results.attacks["paradigm"]))} if not results.attacks.empty else {}
    elif name == "federated-privacy":
        table = T.federated_privacy_table(runs.load_results(folder, *companions) if companions else results)
        tables["federated_privacy"], tables["audit_violations"] = records(table), records(T.audit_violations(table))
    elif name == "cross-device":
        curve = T.cohort_curve(results)
        tables["cohort_curve"], tables["audit_violations"] = records(curve), records(T.audit_violations(curve))
    elif name == "dpmtv":
        tables["mtv"], tables["mtv_claims"] = records(T.mtv_table(results)), records(dp_mtv.claims(results))
    else:
        tables["pruning"] = records(T.pruning_table(results))
        tables["attacks"] = records(T.attack_table(results))
        judged = runs.load_results(folder, *companions) if companions else results
        membership = judged.attacks[judged.attacks["base_attack"].isin(T.MEMBERSHIP_ATTACKS)] \
            if not judged.attacks.empty else judged.attacks
        tables["mia"] = records(
            membership.groupby(["sweep", "paradigm", "policy", "attack"])
            .agg(seeds=("seed", "nunique"), attack_success=("attack_success", "mean"), auc=("auc", "mean"),
                 tpr_at_fpr_01=("tpr_at_fpr_0.01", "mean"), kept_tokens_mean=("kept_tokens_mean", "mean"))
            .reset_index().sort_values(["sweep", "kept_tokens_mean"], ascending=[True, False])) \
            if not membership.empty else []
        tables["baselines"] = records(
            results.attacks[results.attacks["attack"].isin(T.IMAGE_ATTACKS)]
            .groupby("paradigm")[["baseline_psnr", "baseline_ssim", "mark_readback_chance", "mark_readback_originals"]]
            .mean().reset_index())
        tables["claims"] = {p: records(qpriv_vl.claims(judged, p)) for p in sorted(set(results.attacks["paradigm"]))}
    starts = stamp["starts"]
    provenance = merge(starts)
    for local in ("points", "runner", "folder", "started"):
        provenance.pop(local, None)
    return {"provenance": provenance, "starts": len(starts), "sweep": Path(stamp["file"]).name,
            # Every point a start of the sweep named: what a finished sweep holds.
            "points": len({point for start in starts for point in start.get("points", [])}),
            "runs": len(results.runs), "finished": int((results.runs["state"] == "finished").sum()),
            "seconds": sweep_seconds(folder), "tables": tables}


# The pruning sweep's read-back columns (sims/sweeps/pruning-attacks.toml's labels), as attack_table names them.
READBACK_COLUMNS = (("cut_probe_mark_readback", "probe told"), ("cut_probe_unaware_mark_readback", "probe untold"),
                    ("cut_probe-r3_mark_readback", "probe told, r3"), ("fora_psnr", "FORA dB told"),
                    ("fora_unaware_psnr", "FORA dB untold"), ("fora-r3_psnr", "FORA dB r3"),
                    ("actinv_token_recall", "ActInv"), ("actinv-r3_token_recall", "ActInv r3"))


def _f(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


CLAIMS_NOTE = ("Each verdict compares every seed of the settings it names, paired seed by seed and question by "
               "question, with a 95% bootstrap interval over seeds and questions, against the rule's margin: "
               "inconclusive when the interval straddles it; not testable (and why) with fewer than three seeds, "
               "without the runs, or when the attack sits at its floor.")


def claims_table(rows: list[dict[str, Any]]) -> str:
    """A paper's claims: what it reports, the estimate with its interval and n, the verdict, the rule or why not."""
    def measured(r: dict[str, Any]) -> str:
        if r.get("estimate") is None:
            return "—"
        interval = f" [{r['low']:+.3g}, {r['high']:+.3g}]" if r["low"] != r["high"] else ""
        return f"{r['measured']}: {r['estimate']:+.3g}{interval}"

    def judged(r: dict[str, Any]) -> list[str]:
        if "n" in r:
            return [measured(r), r["n"] or "—", r["verdict"], r["reason"]]
        # A result measured before verdicts were paired: one run per point, no interval.
        return [r["measured"], "1 run per point", "not testable",
                f"measured before paired verdicts; the sweep must run again at three seeds or more (then read: "
                f"{r['verdict']}; {r['reason']})"]

    return CLAIMS_NOTE + "\n\n" + markdown_table(["claim", "paper", "measured (95% interval)", "n", "verdict", "rule / why"],
                                                 [[r["claim"], r["paper"], *judged(r)] for r in rows])


def render_report(data: dict[str, Any], folder: Path = RESULTS, name: str = "paradigms") -> Path:
    tables = data["tables"]
    minutes = data["seconds"]["total_s"] / 60
    planned = f" (its starts named {data['points']} points)" if data.get("points", data["runs"]) > data["runs"] else ""
    lines = [f"Sweep `{data['sweep']}`: {data['finished']} of {data['runs']} runs finished{planned}; runs and attacks "
             f"took {minutes:.0f} minutes in all (sum of the points' seconds, {data['starts']} start(s)). "
             "The figures are in `notebooks/results.ipynb`."]
    if data.get("load"):
        lines += ["", f"Load while measuring: {data['load']}"]
    if tables.get("incomplete"):
        lines += ["", "Incomplete run folders: " + ", ".join(f"{r['run']} ({r['reason']})" for r in tables["incomplete"])]
    if "paradigms" in tables:
        lines += ["", "## Paradigms", "", markdown_table(
            ["paradigm", "clients", "steps in sequence", "test acc.", "train loss", "MiB up / round",
             "MiB down / round", "round trips / step", "wall s"],
            [[r["paradigm"].upper(), r["clients"], r["steps"], percent(r["test_accuracy"]), _f(r["train_loss"], ".3f"),
              _f(r["MiB_up_per_round"], ".2f"), _f(r["MiB_down_per_round"], ".2f"),
              _f(r["round_trips_per_step"], ".2f"), _f(r["wall_s"], ".0f")] for r in tables["paradigms"]])]
        lines += ["", "Steps in sequence: optimiser steps taken one after another (FL's clients step in parallel, "
                  "SL's and USL's take turns; every client takes `train.steps_per_round` per round). Bytes are the "
                  "serialised payloads on the wire (CL: evaluation traffic only); a round trip is one message to a "
                  "client and its reply.", "", "Test accuracy per round:", "", markdown_table(
            ["paradigm", "round", "test acc.", "train loss"],
            [[r["paradigm"].upper(), r["round"], percent(r["test_accuracy"]), _f(r["train_loss"], ".3f")]
             for r in tables["rounds"]])]
    if "pruning" in tables:
        lines += ["", "## Pruning (passive server)", "", "Test accuracy: the mean over the policy's seeds; questions: "
                  "scored over all of them.", "", markdown_table(
            ["paradigm", "policy", "seeds", "questions", "test acc.", "kept tokens", "MiB up / round", "patches removed",
             "mark patches removed", "exclusion ratio"],
            [[r["paradigm"].upper(), r["policy"], r.get("seeds", 1), _f(r.get("test_count"), ".0f"),
              percent(r["test_accuracy"]),
              _f(r["kept_tokens_mean"], ".1f"),
              _f(r["MiB_up_per_round"], ".1f"), percent(r["patches_removed_share"]),
              percent(r["mark_patches_removed_share"]), _f(r["exclusion_ratio"], ".2f")] for r in tables["pruning"]])]
        lines += ["", "## Attacks", "", "PSNR in dB; mark: the stamped digit read back from the reconstruction; "
                  "ActInv: question-token recall; iDLG: answer accuracy; MIA: attack success.", "", markdown_table(
            ["paradigm", "server", "policy", "kept tokens", "FORA dB", "FSHA dB", "SARA dB", "mark FORA / FSHA", "ActInv recall",
             "iDLG acc.", "MIA success"],
            # Rows measured before honest and hijacked runs were split carry no server.
            [[r["paradigm"].upper(), r.get("threat", "not split"), r["policy"], _f(r.get("kept_tokens_mean"), ".1f"),
              _f(r.get("fora_psnr"), ".1f"),
              _f(r.get("fsha_psnr"), ".1f"), _f(r.get("sara_psnr"), ".1f"),
              f"{_f(r.get('fora_mark_readback'), '.2f')} / {_f(r.get('fsha_mark_readback'), '.2f')}",
              _f(r.get("actinv_token_recall"), ".2f"), _f(r.get("idlg_label_accuracy"), ".2f"),
              _f(r.get("mia_attack_success"), ".2f")] for r in tables["attacks"]])]
        lines += [""] + [
            f"- {r['paradigm'].upper()}: mean public image {r['baseline_psnr']:.1f} dB (SSIM {r['baseline_ssim']:.2f}); "
            f"mark read-back chance {r['mark_readback_chance']:.2f}, from the original images "
            f"{r['mark_readback_originals']:.2f}." for r in tables["baselines"]]
        readback = [(key, title) for key, title in READBACK_COLUMNS if any(r.get(key) is not None for r in tables["attacks"])]
        if readback:
            lines += ["", "## What crosses the cut, read by attackers told the policy and not, at round 1 and 3", "",
                      "Each number is the mean over the setting's seeds. Cut probe: the stamped digit read from the "
                      "rows at the first cut (told: trained on the policy's own keep sets of the attacker's images; "
                      "untold: on random keep sets of the observed sizes); FORA: PSNR in dB; ActInv: question-token "
                      "recall.", "", markdown_table(
                ["paradigm", "server", "policy", "kept tokens", *(title for _, title in readback)],
                [[r["paradigm"].upper(), r.get("threat", ""), r["policy"], _f(r.get("kept_tokens_mean"), ".1f"),
                  *(_f(r.get(key), ".1f" if "psnr" in key else ".2f") for key, _ in readback)]
                 for r in tables["attacks"] if any(r.get(key) is not None for key, _ in readback)])]
        lines += ["", "Membership (each sweep's own setting: pruning-mia is the memorisation setting of "
                  "sims/sweeps/pruning-mia.toml):", "", markdown_table(
            ["sweep", "paradigm", "policy", "attack", "seeds", "kept tokens", "success", "AUC", "TPR @ 1% FPR"],
            [[r["sweep"], r["paradigm"].upper(), r["policy"], r["attack"], r["seeds"], _f(r["kept_tokens_mean"], ".1f"),
              _f(r["attack_success"], ".3f"), _f(r["auc"], ".3f"), _f(r["tpr_at_fpr_01"], ".3f")]
             for r in tables["mia"]])]
        for paradigm, rows in tables["claims"].items():
            lines += ["", f"## QPriv-VL's claims, {paradigm.upper()}", "", claims_table(rows)]
    if "defenses" in tables:
        columns = [("actinv_token_recall", "ActInv recall"), ("actinv_masked_token_recall", "masked ActInv recall"),
                   ("fora_psnr", "FORA dB"), ("fora_adaptive_psnr", "adaptive FORA dB"), ("fsha_psnr", "FSHA dB"),
                   ("fsha_adaptive_psnr", "adaptive FSHA dB"), ("idlg_label_accuracy", "iDLG acc.")]
        shown = [(key, title) for key, title in columns if any(r.get(key) is not None for r in tables["defenses"])]
        lines += ["", "## Defenses", "", "Each run trained under its defense (test accuracy; a hijacking server's runs, "
                  "FSHA's, have rows of their own: their accuracy is not an honest run's) and attacked by the plain "
                  "attackers and those that know the defense (masked-cosine ActInv; FORA and FSHA whose inverse "
                  "network trains on defended rows). ActInv: question-token recall; image attacks: PSNR in dB; "
                  "iDLG: answer accuracy from USL's gradient at CB.", "", markdown_table(
            ["paradigm", "server", "defense", "test acc.", *(title for _, title in shown)],
            [[r["paradigm"].upper(), r.get("threat", "not split"), r["defense_setting"], percent(r["test_accuracy"]),
              *(_f(r.get(key), ".2f" if "psnr" not in key else ".1f") for key, _ in shown)]
             for r in tables["defenses"]])]
        for paradigm, rows in tables["defense_claims"].items():
            lines += ["", f"## Seed 001's defense claims, {paradigm.upper()}", "", claims_table(rows)]
    if "edge" in tables:
        lines += _edge_sections(tables)
    if "federated_privacy" in tables:
        lines += _federated_privacy_sections(tables)
    if "mtv" in tables:
        lines += _mtv_sections(tables)
    if "cohort_curve" in tables:
        lines += _cohort_sections(tables)
    return write_markdown(name, f"Sweep results: {data['sweep']}", "\n".join(lines), data["provenance"],
                          command=f"{COMMAND} {name.replace('_', '-')}", folder=folder)


# What every image attack's cell in the vision-edge table shows, before its other headline metrics.
IMAGE_CELL = ("ssim", "psnr", "fsim")
CELL = {"ssim": ".2f", "psnr": ".1f", "fsim": ".2f", "mark_readback": ".2f", "position_accuracy": ".1%"}


def edge_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, tuple[str, ...]]]:
    """The vision-edge table's attack columns: (label, title, metrics in its cells) for each image
    attack label the rows hold, in the attack registry's order ("fora_adaptive": "adaptive FORA")."""
    labels = {key.removesuffix("_ssim") for row in rows for key, value in row.items()
              if key.endswith("_ssim") and value is not None}
    columns = []
    for name in T.IMAGE_ATTACKS:
        metrics = (*IMAGE_CELL, *(m for m in ATTACKS.get(name).headline if m not in IMAGE_CELL))
        for label in sorted(label for label in labels if T.label_attack(label) == name):
            variant = label.removeprefix(name).replace("_", " ").strip()
            columns.append((label, f"{variant} {name.upper()}".strip(), metrics))
    return columns


def _edge_sections(tables: dict[str, Any]) -> list[str]:
    """The vision-edge sweep's tables: per paradigm and threat the attacks on each setting, PURI's
    best strength per operation, and seed 002's findings."""
    lines = ["", "## The vision edge", "", "Each run fine-tuned under its operation (test accuracy after fine-tuning). "
             "Cells: SSIM / PSNR dB / FSIM / then SARA's share of rows placed at their patch, or FORA's and FSHA's "
             "stamped-digit read-back. Adaptive: refitted through the attacker's copy of the run's edge. Mean image: "
             "the SSIM / PSNR of the auxiliary images' mean, what an attacker scores for recovering nothing (on "
             "easy-VQA's flat backgrounds its SSIM is above most reconstructions', so the findings below are judged "
             "in PSNR above it)."]
    rows = tables["edge"]
    for paradigm, threat in dict.fromkeys((r["paradigm"], r["threat"]) for r in rows):
        chosen = [r for r in rows if (r["paradigm"], r["threat"]) == (paradigm, threat)]
        shown = edge_columns(chosen)
        lines += ["", f"### {paradigm.upper()}, {threat} server", "", markdown_table(
            ["profile", "policy", "defense", "test acc.", "kept tokens", "mean image",
             *(title for _, title, _ in shown)],
            [[r["profile"], r["policy"], r["defense_setting"], percent(r["test_accuracy"]),
              _f(r.get("kept_tokens_mean"), ".1f"),
              f"{_f(r.get('mean_image_ssim'), '.2f')} / {_f(r.get('mean_image_psnr'), '.1f')}",
              *(" / ".join(_f(r.get(f"{label}_{m}"), CELL[m]) for m in metrics) for label, _, metrics in shown)]
             for r in chosen])]
    if tables["best_puri"]:
        lines += ["", "### PURI (λ = 0.7): the best strength per operation", "", markdown_table(
            ["paradigm", "profile", "policy", "attack", "operation", "best setting", "test acc.", "SSIM", "PURI"],
            [[r["paradigm"].upper(), r["profile"], r["policy"], r["attack"], r["defense_series"], r["defense_setting"],
              percent(r["test_accuracy"]), _f(r["ssim"], ".2f"), _f(r["puri"], ".3f")] for r in tables["best_puri"]])]
    if tables.get("seed_spread"):
        lines += ["", "### Run-to-run spread", "", "The test accuracy of one setting at other LoRA initialisations "
                  "(model.seed; the same data, partition and test questions): differences between settings within "
                  "this range are not differences the sweep can tell apart.", "", markdown_table(
            ["paradigm", "profile", "policy", "defense", "seeds", "test acc. per seed", "mean ± sd", "range"],
            [[r["paradigm"].upper(), r["profile"], r["policy"], r["defense_setting"],
              ", ".join(str(s) for s in r["seeds"]), " / ".join(percent(a) for a in r["accuracies"]),
              f"{percent(r['mean'])} ± {100 * r['std']:.1f} pt", f"{percent(r['min'])}–{percent(r['max'])}"]
             for r in tables["seed_spread"]])]
    for paradigm, claims in tables["edge_claims"].items():
        lines += ["", f"## Seed 002's findings, {paradigm.upper()}", "", claims_table(claims)]
    return lines


# The federated-privacy table's attack columns: (column, title, format).
PRIVACY_COLUMNS = (("idlg_label_precision", "iDLG precision (FL)", ".2f"), ("idlg_label_accuracy", "iDLG acc. (CB)", ".2f"),
                   ("mia_attack_success", "MIA success", ".2f"), ("mia_auc", "MIA AUC", ".2f"),
                   ("mia_tpr_at_fpr_0.01", "MIA TPR @ 1%", ".2f"), ("mia_loss_auc", "loss MIA AUC", ".2f"),
                   ("mia_loss_tpr_at_fpr_0.01", "loss TPR @ 1%", ".2f"), ("mia_loss_tpr_at_fpr_0.001", "loss TPR @ 0.1%", ".2f"),
                   ("fora_psnr", "FORA dB", ".1f"))
# The audits' columns: (attack, title); each shown as its mean over seeds [least, most].
AUDIT_COLUMNS = (("mia", "audit ε (MIA)"), ("mia_loss", "audit ε (loss)"), ("update_audit", "audit ε (updates)"))


def _audit_cell(row: dict[str, Any], attack: str) -> str:
    mean = row.get(f"{attack}_audit_epsilon")
    if mean is None:
        return "—"
    low, high = row.get(f"{attack}_audit_epsilon_min"), row.get(f"{attack}_audit_epsilon_max")
    return f"{mean:.2f}" + (f" [{low:.2f}, {high:.2f}]" if None not in (low, high) and row.get("seeds", 1) > 1 else "")


def _federated_privacy_sections(tables: dict[str, Any]) -> list[str]:
    """Per sweep, paradigm, policy and guarantee: accuracy over the seeds, the accountant's epsilon,
    the attacks, and the canary audits' epsilon lower bounds, which must stay below the accountant's."""
    rows = tables["federated_privacy"]
    shown = [(key, title, spec) for key, title, spec in PRIVACY_COLUMNS if any(r.get(key) is not None for r in rows)]
    audits = [(attack, title) for attack, title in AUDIT_COLUMNS if any(r.get(f"{attack}_audit_epsilon") is not None
                                                                         for r in rows)]
    lines = ["", "## Federated privacy", "", "Each run trained under its guarantee (privacy.dp, privacy.secagg) with "
             "canaries in its data (data.canaries); ε: the accountant's after the last round, the most any seed spent "
             "(DP-SGD: the worst client's; clip-only: the same clipping, no noise, no ε). Test accuracy over every "
             "seed's questions (95% bootstrap interval: seeds, then questions). iDLG precision (FL): the share of an "
             "update's batch's answer tokens among the tokens it scores highest; iDLG acc. (CB): each sample's answer "
             "read from USL's gradient at CB. Membership: on the canaries, the mean over seeds; audit ε: the one-run "
             "lower bound at 95% (Steinke et al. 2023), the mean over seeds [least, most]; the updates' from 1,000 "
             "update canaries (threat.update_canaries). memorisation-audit: the memorisation setting with 100 "
             "input-space canaries (sims/sweeps/memorisation-audit.toml). In SL and USL a client's ε covers its own "
             "segments only: the server's segment trains on its activations without DP, so the attacks on the model "
             "it deploys are not bounded by that ε (docs/privacy.md); FL's model is its clients' updates, covered.", "",
             markdown_table(["sweep", "paradigm", "server", "policy", "guarantee", "seeds", "test acc.", "95% interval",
                             "ε", *(title for _, title, _ in shown), *(title for _, title in audits)],
                            [[r.get("sweep", ""), r["paradigm"].upper(), r.get("threat", "not split"), r["policy"],
                              r["privacy_setting"], r.get("seeds", 1), percent(r["test_accuracy"]),
                              f"[{percent(r['accuracy_low'])}, {percent(r['accuracy_high'])}]"
                              if r.get("accuracy_low") is not None else "—",
                              _f(r.get("accountant_epsilon"), ".2f"), *(_f(r.get(key), spec) for key, _, spec in shown),
                              *(_audit_cell(r, attack) for attack, _ in audits)]
                             for r in rows])]
    violations = tables["audit_violations"]
    lines += ["", f"Audit bounds above the accountant's ε at any seed: {len(violations)}" + (
        " — " + ", ".join(f"{r['paradigm'].upper()} {r['policy']} {r['privacy_setting']}" for r in violations)
        if violations else " (as it must be).")]
    return lines


def _cohort_sections(tables: dict[str, Any]) -> list[str]:
    """DP-FedAvg's accuracy against the cohort, and each run's update audit beside its accountant."""
    rows = tables["cohort_curve"]
    lines = ["", "## DP-FedAvg against the cohort", "",
             "Test accuracy over every seed's test questions (95% bootstrap interval: seeds, then questions); "
             "cohort: the clients a round averages (poisson: the expected cohort, each client in by its own coin, "
             "and the accountant amplifies by sampling; fixed: every client every round, no amplification). ε: the "
             "accountant's after the last round; audit ε: the one-run lower bound at 95% from 1,000 update canaries "
             "(mean and max over seeds; update_audit), which must never exceed it. Round s: the median wall seconds of "
             "a training round (single-threaded, beside the sweep's other processes; see the load above).", "",
             markdown_table(["clients", "sampling", "cohort", "guarantee", "canaries", "test acc.", "95% interval", "n",
                             "ε", "audit ε (mean)", "audit ε (max)", "round s"],
                            [[r["clients"], r["sampling"], r["cohort"], r["privacy_setting"], r["update_canaries"],
                              percent(r["test_accuracy"]),
                              f"[{percent(r['accuracy_low'])}, {percent(r['accuracy_high'])}]",
                              f"{r['seeds']} seeds × {r['questions']} questions", _f(r.get("accountant_epsilon"), ".2f"),
                              _f(r.get("audit_epsilon"), ".2f"), _f(r.get("audit_epsilon_max"), ".2f"),
                              _f(r.get("round_s"), ".0f")] for r in rows])]
    violations = tables["audit_violations"]
    lines += ["", f"Audit bounds above the accountant's ε: {len(violations)}" + (
        " — " + ", ".join(f"{r['clients']} clients, cohort {r['cohort']}, {r['privacy_setting']}" for r in violations)
        if violations else " (as it must be).")]
    return lines


def _mtv_sections(tables: dict[str, Any]) -> list[str]:
    """The task-vector runs: accuracy with the released vector and zero-shot at each setting and ε,
    the gain kept, the bytes a client sent, the membership audit, and seed 003's claims."""
    rows = tables["mtv"]
    audited = any(r.get("audit_auc") is not None for r in rows)
    lines = ["", "## Task vectors (DP-MTV)", "", "Each run released one task vector from the clients' private rows "
             "and scored the same test questions with it and zero-shot. ε: the ledger's total (ε_tv, plus ε_sel under "
             "private selection; — for non-private MTV). Gain kept: the share of the non-private vector's gain over "
             "zero-shot at the same setting. Noise: who drew it (distributed: the clients, under SecAgg+). Draw: "
             "privacy.seed, which seeds the chunks, the noise and REINFORCE. ε_tv ∞: "
             "non-private MTV (JSON keeps no infinity, so the table's source holds null there).", "",
             markdown_table(["dataset", "clients", "noise", "selection", "m", "K", "ε_tv", "draw", "ε", "test acc.", "zero-shot",
                             "gain kept", "bytes up / client", *(("audit AUC", "audit ε bound") if audited else ())],
                            [[r["dataset"], r["clients"], r["noise"] + (" + SecAgg+" if r["secagg"] else ""), r["selection"],
                              r["chunks"], r["shots"], "∞" if r["epsilon_tv"] is None else _f(r["epsilon_tv"], "g"),
                              r["seed"], _f(r["epsilon"], ".2g"),
                              percent(r["test_accuracy"]), percent(r["zero_shot_accuracy"]), percent(r["gain_kept"]),
                              _f(r["bytes_up_per_client"], ",.0f"),
                              *((_f(r.get("audit_auc"), ".2f"), _f(r.get("audit_audit_epsilon"), ".2f")) if audited else ())]
                             for r in rows])]
    lines += ["", "## Seed 003's claims", "", claims_table(tables["mtv_claims"])]
    return lines


def sweep_candidates(name: str) -> list[Path]:
    """Where a sweep's folder is looked for: this machine's, else its archive."""
    return [Path.home() / "qpriv-sweeps" / name, RESULTS / "sweeps" / name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=SWEEPS)
    parser.add_argument("--sweep", type=Path,
                        help="the sweep folder (default ~/qpriv-sweeps/<name>, else its archive results/sweeps/<name>)")
    parser.add_argument("--load", default="", help="what else ran on the machine while the sweep ran (kept in the JSON)")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    args = parser.parse_args()
    result_name = args.name.replace("-", "_")
    if not args.report:
        candidates = [args.sweep.expanduser()] if args.sweep else sweep_candidates(args.name)
        folder = next((c for c in candidates if (c / SWEEP_STAMP).exists()), None)
        if folder is None:
            raise SystemExit(f"{' nor '.join(map(str, candidates))} is a sweep folder: run "
                             f"`qpriv-sweep run sims/sweeps/{args.name}.toml --archive results/sweeps/{args.name}` first")
        companions = tuple(found for found in (next((c for c in sweep_candidates(name) if (c / SWEEP_STAMP).exists()), None)
                                               for name in COMPANIONS.get(args.name, ())) if found is not None)
        write_json(result_name, {**measure(args.name, folder, companions), "load": args.load})
    path = render_report(read_json(result_name), RESULTS, result_name)
    print(path.read_text())


if __name__ == "__main__":
    main()
