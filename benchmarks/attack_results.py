"""What each attack recovers from what crossed the cuts, per paradigm and pruning policy (issue 5, "Results").

    python benchmarks/attack_results.py [--paradigms usl sl] [--policies off fixed-0.5 dtp] [--work DIR]
    python benchmarks/attack_results.py --report

For each paradigm (USL, SL) and pruning policy (off, fixed ρ = 0.3/0.5/0.7/0.9, DTP) the
mini model is fine-tuned on the stamped benchmark (`easyvqa-stamped`, a handwritten digit
in half the images) twice, in process, with the same strategy and client objects
`flwr run` uses:

- under a passive server (`threat.model=passive`), whose recording FORA, ActInv and SARA
  invert and whose fine-tuned model MIA (and its attribute-inference variant) queries;
- under an FSHA server (`threat.model=active-fsha`), whose recording FSHA decodes.

Every attack goes through `attacks.replay.replay`, the path `python -m attacks run`
takes; the passive attacks whose training reads only public data (ActInv, SARA, MIA) are
fitted once per paradigm and replayed on every policy's run. Image attacks report PSNR,
SSIM and FSIM against the mean public image, and on stamped images whether a digit
classifier reads the mark back from the reconstruction (vs chance and vs the original
images). Runs and results live under --work, one folder per run; a run resumes and an
attack whose result is there is not run again, so an interrupted sweep picks up where it
stopped. Writes results/attack_results.json and .png, and results/attack_results.md from the
JSON (printed too); --report only re-renders the markdown.

Fixed ratios and DTP rank patches with the same trained module (α = β = 1), so they differ
only in how many tokens they keep: the DTP artefacts of the pruning benchmark
(benchmarks/pruning_tradeoffs.py), prepared before the first pruned run if missing
(`qpriv-prune prepare`, about a minute).
"""

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_limits

from attacks.base import Attack
from attacks.replay import fit_for_run, replay
from pruning import DTP_FILE, ORACLE_FILE
from pruning.prepare import PrepareSettings, prepare_dtp
from sims.inprocess import run_in_process
from config import load_config
from vlm.mini import MiniRecipe
from vlm.mini.build import cache_root

from report import (
    REPORT_HELP,
    RESULTS,
    markdown_table,
    percent,
    provenance,
    read_json,
    span,
    write_json,
    write_markdown,
)

NAME = "attack_results"
COMMAND = "python benchmarks/attack_results.py"
DATASET = "easyvqa-stamped"
PASSIVE_ATTACKS = ("fora", "actinv", "sara", "mia")
# Fitted on public data only, so one fit serves every policy's run of a paradigm.
SHARED_FITS = ("actinv", "sara", "mia")
PAPER_MIA = {"undefended": 0.99, "qpriv_vl": (0.76, 0.79)}


@dataclass(frozen=True)
class Policy:
    key: str
    policy: str
    ratio: float = 0.0

    def overrides(self, artefacts: Path) -> dict[str, Any]:
        settings = {"pruning.policy": self.policy, "pruning.ratio": self.ratio}
        if self.policy != "off":
            settings["pruning.artifacts"] = str(artefacts)
        return settings


POLICIES = {
    p.key: p
    for p in (
        Policy("off", "off"),
        *(Policy(f"fixed-{r:g}", "fixed", r) for r in (0.3, 0.5, 0.7, 0.9)),
        Policy("dtp", "dtp"),
    )
}


@dataclass(frozen=True)
class Budget:
    """Run and attack sizes: the defaults fit the sweep into about an hour on 2 CPU cores."""

    train_limit: int = 600
    test_limit: int = 200
    rounds: int = 2
    steps_per_round: int = 30
    batch_size: int = 16
    lr: float = 5e-4
    recorded_samples: int = 512
    aux_limit: int = 512
    fsha_pretrain_steps: int = 300
    fora_substitute_steps: int = 250
    fora_decoder_steps: int = 1200
    actinv_iterations: int = 300
    actinv_transfers: int = 2
    sara_tpp_steps: int = 1000
    sara_mae_steps: int = 800
    sara_decoder_steps: int = 1500
    mia_shadows: int = 4
    mia_shadow_records: int = 256
    mia_candidates: int = 256

    def attack_options(self, attack: str) -> dict[str, Any]:
        return {
            "fora": {"substitute_steps": self.fora_substitute_steps, "decoder_steps": self.fora_decoder_steps},
            "actinv": {"iterations": self.actinv_iterations, "max_transfers": self.actinv_transfers},
            # Keep shares down to what fixed 0.9 leaves, order shuffled or not: the client keeps ascending order.
            "sara": {"tpp_steps": self.sara_tpp_steps, "mae_steps": self.sara_mae_steps,
                     "decoder_steps": self.sara_decoder_steps, "keep_ratios": (0.1, 1.0), "shuffle": False},
            "mia": {"shadows": self.mia_shadows, "shadow_records": self.mia_shadow_records,
                    "candidates": self.mia_candidates},
            "fsha": {},
        }[attack] | {"progress": False}


def run_config(paradigm: str, policy: Policy, threat: str, budget: Budget, args: argparse.Namespace) -> dict:
    return {
        "paradigm": paradigm,
        "model.profile": args.profile,
        "data.dataset": DATASET,
        "data.train_limit": budget.train_limit,
        "data.test_limit": budget.test_limit,
        "clients.count": 2,
        "train.rounds": budget.rounds,
        "train.steps_per_round": budget.steps_per_round,
        "train.batch_size": budget.batch_size,
        "train.lr": budget.lr,
        "eval.every": budget.rounds,
        "threat.model": threat,
        "threat.max_samples": budget.recorded_samples,
        "threat.aux_limit": budget.aux_limit,
        "threat.fsha_pretrain_steps": budget.fsha_pretrain_steps,
        "output.root": str(args.work),
        "output.name": f"{paradigm}-{policy.key}-{threat}",
        **policy.overrides(args.artefacts),
    }


def finished_run(raw: dict) -> Path:
    """The run's folder, run (or resumed) to its last round."""
    folder = load_config(raw).run_folder()
    status = folder / "status.json"
    if not (status.exists() and json.loads(status.read_text()).get("state") == "finished"):
        print(f"running {raw['output.name']}", flush=True)
        folder = run_in_process(raw).path
    return folder


def last_metrics(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])


def saved_result(folder: Path, attack: str) -> dict[str, Any] | None:
    path = folder / "attacks" / f"{attack}.json"
    return json.loads(path.read_text())["metrics"] if path.exists() else None


def sweep_paradigm(paradigm: str, policies: Sequence[Policy], budget: Budget, args) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    shared: dict[str, Attack] = {}
    for policy in policies:
        if policy.policy != "off":
            prepare_artefacts(args)
        row: dict[str, Any] = {"policy": asdict(policy)}
        passive = finished_run(run_config(paradigm, policy, "passive", budget, args))
        metrics = last_metrics(passive)
        row["run"] = {key: metrics.get(key) for key in (
            "test_accuracy", "kept_tokens_mean", "kept_tokens_std", "patches_removed_share",
            "mark_patches_removed_share", "bytes_up")}
        row["attacks"] = {}
        for attack in PASSIVE_ATTACKS:
            result = saved_result(passive, attack)
            if result is None:
                print(f"{paradigm} {policy.key}: {attack}", flush=True)
                if attack in SHARED_FITS:
                    if attack not in shared:
                        print(f"fitting {attack} for {paradigm}", flush=True)
                        shared[attack] = fit_for_run(passive, attack, options=budget.attack_options(attack))
                    result = replay(passive, shared[attack]).metrics
                else:
                    result = replay(passive, attack, options=budget.attack_options(attack)).metrics
            row["attacks"][attack] = result
        active = finished_run(run_config(paradigm, policy, "active-fsha", budget, args))
        row["active_run"] = {key: last_metrics(active).get(key) for key in ("test_accuracy", "kept_tokens_mean")}
        result = saved_result(active, "fsha")
        if result is None:
            print(f"{paradigm} {policy.key}: fsha", flush=True)
            result = replay(active, "fsha", options=budget.attack_options("fsha")).metrics
        row["attacks"]["fsha"] = result
        rows[policy.key] = row
    return rows


# --- the paper's claims ----------------------------------------------------------------------


def fixed_trend(rows: dict[str, Any], attack: str) -> tuple[np.ndarray, np.ndarray]:
    """(mean kept tokens, PSNR) of the fixed ratios, by kept tokens."""
    points = sorted(
        (row["run"]["kept_tokens_mean"], row["attacks"][attack]["psnr"])
        for row in rows.values()
        if row["policy"]["policy"] == "fixed" and "psnr" in row["attacks"].get(attack, {})
    )
    return np.array([p[0] for p in points]), np.array([p[1] for p in points])


def dtp_vs_fixed_trend(rows: dict[str, Any], attack: str) -> dict[str, Any] | None:
    """DTP's PSNR against the fixed-ratio curve at DTP's own mean kept tokens (the nearest
    fixed ratio's where DTP keeps more or fewer tokens than all of them), and whether
    pruned reconstructions beat the mean public image at all."""
    dtp = rows.get("dtp")
    if dtp is None or "psnr" not in dtp["attacks"].get(attack, {}):
        return None
    kept, psnr = fixed_trend(rows, attack)
    if len(kept) < 2:
        return None
    tokens = dtp["run"]["kept_tokens_mean"]
    at = float(np.interp(tokens, kept, psnr))
    gap = dtp["attacks"][attack]["psnr"] - at
    return {"dtp_psnr": dtp["attacks"][attack]["psnr"], "dtp_kept_tokens": tokens, "fixed_trend_psnr": at,
            "within_fixed_range": bool(kept[0] <= tokens <= kept[-1]), "gap_db": gap,
            "dtp_below_trend": bool(gap < 0), "fixed_spread_db": float(psnr.max() - psnr.min()),
            "mean_image_psnr": dtp["attacks"][attack].get("baseline_psnr")}


def claims(results: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for paradigm, rows in results["paradigms"].items():
        found[paradigm] = {attack: dtp_vs_fixed_trend(rows, attack) for attack in ("fsha", "fora")}
        off, dtp = rows.get("off"), rows.get("dtp")
        if off and dtp:
            found[paradigm]["mia_success"] = {
                "off": off["attacks"]["mia"].get("attack_success"), "dtp": dtp["attacks"]["mia"].get("attack_success"),
                "paper": PAPER_MIA,
            }
    return found


# --- report ----------------------------------------------------------------------------------


def cell(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_report(results: dict[str, Any], folder: Path = RESULTS, name: str = NAME) -> Path:
    """<folder>/<name>.md from the results in <name>.json beside it (another --out than results/ names another)."""
    body = "\n\n".join(
        [table_section(results), findings_section(results),
         f"![PSNR vs kept tokens per attack, and what else the attacker recovers]({name}.png)"]
    )
    return write_markdown(
        name, "What the attacks recover, per paradigm and pruning policy", body, results.get("provenance"),
        command=COMMAND, folder=folder,
    )


def pruned(rows: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in rows.values() if row["policy"]["policy"] != "off"]


def table_section(results: dict[str, Any]) -> str:
    budget = results["setup"]["budget"]
    rows, baselines = [], []
    for paradigm, policies in results["paradigms"].items():
        for key, row in policies.items():
            a = row["attacks"]
            rows.append([
                paradigm.upper(), key, cell(row["run"]["kept_tokens_mean"], ".3g"),
                percent(row["run"]["test_accuracy"]),
                cell(a["fsha"].get("psnr"), ".1f"),
                cell(a["fora"].get("psnr"), ".1f"),
                cell(a["sara"].get("psnr"), ".1f"),
                f"{cell(a['fsha'].get('mark_readback'), '.2f')} / {cell(a['fora'].get('mark_readback'), '.2f')}",
                cell(a["sara"].get("position_accuracy"), ".3f"),
                cell(a["actinv"].get("token_recall"), ".2f"),
                f"{cell(a['mia'].get('attack_success'), '.2f')} / {cell(a['mia'].get('auc'), '.2f')}",
            ])
        first = next(iter(policies.values()))["attacks"]["fora"]
        baselines.append(
            f"- {paradigm.upper()}: mean public image {cell(first.get('baseline_psnr'), '.1f')} dB; mark read-back "
            f"chance (most common digit) {cell(first.get('mark_readback_chance'), '.2f')}, from the original images "
            f"{cell(first.get('mark_readback_originals'), '.2f')}."
        )
    table = markdown_table(
        ["paradigm", "policy", "kept tokens", "test acc.", "FSHA dB", "FORA dB", "SARA dB", "mark FSHA / FORA",
         "SARA position acc.", "ActInv recall", "MIA success / AUC"],
        rows,
    )
    setup = (
        f"The {results['setup']['profile']} base fine-tuned on `{results['setup']['dataset']}`: 2 clients × "
        f"{budget['train_limit'] // 2} training rows, {budget['rounds']} rounds × {budget['steps_per_round']} "
        f"steps of {budget['batch_size']}, lr {budget['lr']:g}; each policy run once under a passive server (FORA, SARA, "
        f"ActInv, MIA) and once under an FSHA server. Reconstructions are scored on the {budget['recorded_samples']} "
        f"recorded samples; test accuracy is on {budget['test_limit']} questions; \"mark\" is a digit classifier "
        "reading the stamp back from the reconstruction."
    )
    return "\n".join(["## Per paradigm and policy", "", setup, "", table, "", *baselines])


def findings_section(results: dict[str, Any]) -> str:
    lines = ["## The paper's claims, checked", ""]
    for paradigm, rows in results["paradigms"].items():
        name = paradigm.upper()
        off = rows.get("off")
        if off:
            a = off["attacks"]
            lines.append(
                f"- {name}, no pruning: FORA {cell(a['fora'].get('psnr'), '.1f')} dB and FSHA "
                f"{cell(a['fsha'].get('psnr'), '.1f')} dB against {cell(a['fora'].get('baseline_psnr'), '.1f')} dB for "
                f"the mean public image; the mark is read back {cell(a['fora'].get('mark_readback'), '.2f')} (FORA) / "
                f"{cell(a['fsha'].get('mark_readback'), '.2f')} (FSHA), chance "
                f"{cell(a['fora'].get('mark_readback_chance'), '.2f')}."
            )
        cut = pruned(rows)
        if cut:
            lines.append(
                f"- {name}, pruned (every fixed ratio and DTP): "
                f"FORA {span(r['attacks']['fora'].get('psnr') for r in cut)} dB, "
                f"FSHA {span(r['attacks']['fsha'].get('psnr') for r in cut)} dB, mark read-back "
                f"{span((r['attacks']['fora'].get('mark_readback') for r in cut), '.2f')} (FORA) / "
                f"{span((r['attacks']['fsha'].get('mark_readback') for r in cut), '.2f')} (FSHA)."
            )
        for attack in ("fsha", "fora"):
            claim = results["claims"][paradigm].get(attack)
            if claim is None:
                continue
            where = "" if claim["within_fixed_range"] else " (outside the fixed ratios' tokens: the nearest one's)"
            lines.append(
                f"- {name} {attack.upper()}: DTP {claim['dtp_psnr']:.1f} dB at {claim['dtp_kept_tokens']:.1f} tokens, "
                f"the fixed-ratio trend {claim['fixed_trend_psnr']:.1f} dB there{where}: "
                f"DTP is {'below' if claim['dtp_below_trend'] else 'not below'} the trend "
                f"({claim['gap_db']:+.2f} dB; the fixed ratios span {claim['fixed_spread_db']:.2f} dB)."
            )
        sara = [r["attacks"]["sara"] for r in cut]
        if sara:
            lines.append(
                f"- {name} SARA under pruning: token positions placed correctly "
                f"{span((s.get('position_accuracy') for s in sara), '.1f', 100)}% (chance "
                f"{span((s.get('chance_position_accuracy') for s in sara), '.1f', 100)}%; spreading the in-order rows "
                f"evenly {span((s.get('spread_position_accuracy') for s in sara), '.1f', 100)}%), reconstructions "
                f"{span(s.get('psnr') for s in sara)} dB."
            )
        lines.append(
            f"- {name} ActInv token recall at the first cut: "
            f"{span((r['attacks']['actinv'].get('token_recall') for r in rows.values()), '.2f')}"
            + (f" (no pruning {cell(off['attacks']['actinv'].get('token_recall'), '.2f')})." if off else ".")
        )
        mia = [r["attacks"]["mia"] for r in rows.values()]
        paper = results["claims"][paradigm].get("mia_success", {}).get("paper", PAPER_MIA)
        lines.append(
            f"- {name} MIA: success {span((m.get('attack_success') for m in mia), '.2f')}, AUC "
            f"{span((m.get('auc') for m in mia), '.2f')} in every cell (paper: {paper['undefended']} undefended, "
            f"{paper['qpriv_vl'][0]}–{paper['qpriv_vl'][1]} with QPriv-VL); attribute inference "
            f"{span((m.get('attribute_accuracy') for m in mia), '.2f')} against its prior "
            f"{span((m.get('baseline_attribute_accuracy') for m in mia), '.2f')}."
        )
        lines.append(
            f"- {name} utility: test accuracy {span((r['run']['test_accuracy'] for r in rows.values()), '.1f', 100)}% "
            "over the policies."
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    paradigms = list(results["paradigms"])
    fig, axes = plt.subplots(2, len(paradigms), figsize=(6.5 * len(paradigms), 9), squeeze=False)
    for column, paradigm in enumerate(paradigms):
        rows = results["paradigms"][paradigm]
        top = axes[0, column]
        for attack, colour in (("fsha", "tab:red"), ("fora", "tab:blue"), ("sara", "tab:green")):
            kept, psnr = fixed_trend(rows, attack)
            top.plot(kept, psnr, "o-", color=colour, label=f"{attack.upper()} fixed ρ")
            off = rows.get("off", {}).get("attacks", {}).get(attack, {})
            if "psnr" in off:
                top.plot(rows["off"]["run"]["kept_tokens_mean"], off["psnr"], "s", ms=9, color=colour,
                         label=f"{attack.upper()} no pruning")
            dtp = rows.get("dtp", {}).get("attacks", {}).get(attack, {})
            if "psnr" in dtp:
                top.plot(rows["dtp"]["run"]["kept_tokens_mean"], dtp["psnr"], "*", ms=16, color=colour,
                         label=f"{attack.upper()} DTP")
        baseline = next((row["attacks"]["fora"].get("baseline_psnr") for row in rows.values()), None)
        if baseline is not None:
            top.axhline(baseline, color="gray", ls="--", label="mean public image")
        top.set(title=f"{paradigm.upper()}: reconstruction vs visual tokens sent", xlabel="mean kept visual tokens",
                ylabel="PSNR (dB)")
        top.legend(fontsize=8)

        bottom = axes[1, column]
        keys = list(rows)
        x = np.arange(len(keys))
        series = {
            "mark read-back FSHA": [rows[k]["attacks"]["fsha"].get("mark_readback") for k in keys],
            "mark read-back FORA": [rows[k]["attacks"]["fora"].get("mark_readback") for k in keys],
            "SARA position acc.": [rows[k]["attacks"]["sara"].get("position_accuracy") for k in keys],
            "ActInv token recall": [rows[k]["attacks"]["actinv"].get("token_recall") for k in keys],
            "MIA success": [rows[k]["attacks"]["mia"].get("attack_success") for k in keys],
        }
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            bottom.bar(x + i * width, [np.nan if v is None else v for v in values], width, label=label)
        chance = next((row["attacks"]["fora"].get("mark_readback_chance") for row in rows.values()), None)
        if chance is not None:
            bottom.axhline(chance, color="gray", ls=":", label="mark read-back chance")
        bottom.set(xticks=x + 0.4 - width / 2, xticklabels=keys, ylim=(0, 1.05),
                   title=f"{paradigm.upper()}: what else the attacker recovers")
        bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prepare_artefacts(args: argparse.Namespace) -> None:
    """The DTP artefacts in `args.artefacts`, prepared if a file is missing."""
    if not all((args.artefacts / name).is_file() for name in (DTP_FILE, ORACLE_FILE)):
        print(f"preparing DTP into {args.artefacts}", flush=True)
        # The tiny profile (a smoke run) has random weights only; DTP is prepared on them.
        stage = "random" if args.profile == "tiny" else "vqa"
        prepare_dtp(PrepareSettings(profile=args.profile, model_stage=stage), args.artefacts, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paradigms", nargs="+", default=["usl", "sl"], choices=["usl", "sl"])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--profile", default="mini", help="model profile (tiny: a minutes-long smoke run)")
    parser.add_argument("--work", type=Path, default=None, help="runs and attack results (default: the cache)")
    parser.add_argument("--artefacts", type=Path, default=None, help="prepared DTP artefacts (default: the cache)")
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (the machine is shared)")
    parser.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    for name, default in asdict(Budget()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    if args.report:
        print(f"wrote {render_report(read_json(args.out.stem, args.out.parent), args.out.parent, args.out.stem)}")
        return
    budget = Budget(**{name: getattr(args, name) for name in asdict(Budget())})
    fingerprint = MiniRecipe().fingerprint()
    args.work = args.work or cache_root() / "attack-results" / f"{args.profile}-{fingerprint}"
    args.artefacts = args.artefacts or cache_root() / "pruning-tradeoffs" / fingerprint / "dtp-alpha1"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with threadpool_limits(args.threads):
        import torch

        torch.set_num_threads(args.threads)
        policies = [POLICIES[key] for key in args.policies]
        results: dict[str, Any] = {
            "provenance": provenance(),
            "setup": {"budget": asdict(budget), "profile": args.profile, "dataset": DATASET,
                      "mini_recipe": fingerprint, "work": str(args.work)},
            "paradigms": {},
        }
        for paradigm in args.paradigms:
            results["paradigms"][paradigm] = sweep_paradigm(paradigm, policies, budget, args)
    results["claims"] = claims(results)
    write_json(args.out.stem, results, args.out.parent)
    plot(results, args.out.with_suffix(".png"))
    # Rendered from the file, so the markdown is exactly what --report makes of it.
    print(render_report(read_json(args.out.stem, args.out.parent), args.out.parent, args.out.stem).read_text())


if __name__ == "__main__":
    main()
