"""Run folders as pandas tables: what the results notebook and results/*.md are drawn from.

    results = load_results("~/qpriv-sweeps/paradigms", "~/qpriv-runs/my-run")
    results.runs       # one row per run: its settings, state and final metrics
    results.rounds     # one row per run x round (metrics.jsonl)
    results.attacks    # one row per run x attack result (<run>/attacks/<label>.json)
    results.incomplete # run folders that could not be read, and why

Any folder is searched for run folders (those holding config.json), so a sweep folder, a
folder of sweeps, a sweep's archive (sims/archive.py) or single runs all load the same way. A run folder that lacks a file or
holds a torn one is listed in `incomplete` with the reason, never raised. The helpers below
(`mia_roc`, `reconstructions`, `claims`, `defense_claims`, `edge_claims`, `defense_frontier`,
`defense_table`) read only what a run wrote, and what each registered method declares of itself
(a defense's strength option, an attack's kind and headline metrics, a policy's budget). A
defended run's `defense_setting` names each defense with its strength and the options that
differ from its defaults; a single-defense run also has a `defense_series` (the setting without
its strength) and a `defense_strength`, the frontier's line and x.

An attack result's `attack` is the label it was saved under: a sweep may replay one attack
several times with other options (`[attacks.actinv_masked] attack = "actinv"`), and each label
is its own `attack` value ("actinv_masked", "fora_adaptive") beside the plain one; `base_attack`
is the registered attack behind it (the headline metric comes from it).

Colours come from the registries' order, so a method has one colour in every figure
(`ATTACK_COLORS`, `PARADIGM_COLORS`).
"""

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from safetensors.torch import load_file
from sklearn.metrics import roc_curve

from attacks.base import ATTACKS, IMAGE, MEMBERSHIP, PASSIVE
from attacks.context import ATTACK_FOLDER
from attacks.metrics import PURI_LAMBDA, puri
from config import threats
from privacy import DEFENSES, EDGE, defense_class, options_from, parse_defense_names
from pruning import POLICIES
from sims.archive import MARKER as ARCHIVE_MARKER
from vlm.paradigms import MTV, PARADIGMS

# Settings every table carries, from the run's resolved config.
SETTINGS = {
    "paradigm": "paradigm", "profile": "model.profile", "dataset": "data.dataset", "policy_name": "pruning.policy",
    "ratio": "pruning.ratio", "threat": "threat.model", "clients": "clients.count", "rounds_planned": "train.rounds",
    "steps_per_round": "train.steps_per_round", "batch_size": "train.batch_size", "model_seed": "model.seed",
}
# The config key naming a run's defenses at the cut, in order ("noise,pripert"; "" or "none": none);
# each one's options are the keys under privacy.<name>.
DEFENSES_KEY = "privacy.defenses"
NO_DEFENSE = "none"
IMAGE_ATTACKS = tuple(attack.name for attack in ATTACKS if attack.kind == IMAGE)
MEMBERSHIP_ATTACKS = tuple(attack.name for attack in ATTACKS if attack.kind == MEMBERSHIP)
# The defenses that act inside the vision tower (privacy.edge).
EDGE_DEFENSES = tuple(defense.name for defense in DEFENSES if defense.stage == EDGE)
# matplotlib's default colour cycle: the n-th registered method takes the n-th colour.
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")


def colors(names: Iterable[str]) -> dict[str, str]:
    """A colour per name, in order (past ten the cycle repeats)."""
    return {name: PALETTE[index % len(PALETTE)] for index, name in enumerate(names)}


ATTACK_COLORS = colors(ATTACKS.names())
# The training paradigms (the task-vector runs have figures of their own).
PARADIGM_COLORS = colors(paradigm.name for paradigm in PARADIGMS if paradigm.trains)
PAPER_MIA_UNDEFENDED = 0.99
PAPER_MIA_QPRIV = (0.76, 0.79)
PAPER_EXCLUSION_RATIO = (1.20, 0.18)
EXCLUSION_HOLDS = PAPER_EXCLUSION_RATIO[0] - PAPER_EXCLUSION_RATIO[1]
PAPER_TOKEN_BUDGET = 0.40
PAPER_ACTINV_RECALL = 0.99
# "Competitive accuracy": within this many points of the unpruned run (the paper gives no number).
COMPETITIVE_POINTS = 0.05


@dataclass
class Results:
    runs: pd.DataFrame
    rounds: pd.DataFrame
    attacks: pd.DataFrame
    incomplete: pd.DataFrame

    def finished(self) -> pd.DataFrame:
        return self.runs[self.runs["state"] == "finished"]


def find_run_folders(paths: Iterable[str | Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        path = Path(path).expanduser()
        if (path / "config.json").exists():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(p.parent for p in path.rglob("config.json")
                                if (p.parent / "checkpoints").is_dir() or (p.parent / ARCHIVE_MARKER).is_file()))
    return list(dict.fromkeys(found))


def policy_label(config: dict[str, Any]) -> str:
    """The run's pruning policy as the papers name it, with its budget where it has one: off, fixed-0.5, dtp, oracle."""
    policy = config.get("pruning.policy", "off")
    budget = POLICIES.get(policy).budget if policy in POLICIES else None
    return policy if budget is None else f"{policy}-{config.get(f'pruning.{budget}', 0.0):g}"


def defense_names(config: dict[str, Any]) -> list[str]:
    """The run's defenses at the cut, in order."""
    return parse_defense_names(str(config.get(DEFENSES_KEY) or ""))


def _configured(config: dict[str, Any], name: str) -> dict[str, Any]:
    """Defense `name`'s options as the run's config holds them (its keys `privacy.<name>.<option>`)."""
    prefix = f"privacy.{name}."
    return {key[len(prefix):]: value for key, value in sorted(config.items()) if key.startswith(prefix)}


def _strength_option(config: dict[str, Any], name: str) -> str | None:
    """The option that sets defense `name`'s strength in the run (None: it has none)."""
    defense = defense_class(name)
    declared = asdict(defense.Options())
    return defense.strength_option(options_from(defense, {option: value for option, value in
                                                          _configured(config, name).items() if option in declared}))


def _options(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A defense's options in the run that differ from the defense's defaults, and its strength."""
    defaults = asdict(defense_class(name).Options())
    strength = _strength_option(config, name)
    return {option: value for option, value in _configured(config, name).items()
            if value != defaults.get(option) or option == strength}


def _label(name: str, options: dict[str, Any]) -> str:
    def shown(key: str, value: Any) -> str:
        if isinstance(value, float):
            return f"{value:g}"
        # An artefact by its folder's name (a sweep's positionless edge: its label).
        return Path(value).name if key == "artifact" else str(value)

    text = ", ".join(f"{key}={shown(key, value)}" for key, value in options.items())
    return f"{name}({text})" if text else name


def defense_setting(config: dict[str, Any]) -> str:
    """The defenses with their strength and the options that differ from their defaults:
    "sparsify(ratio=0.7)+noise(variance=0.01)"."""
    names = defense_names(config)
    return "+".join(_label(name, _options(config, name)) for name in names) if names else NO_DEFENSE


def privacy_setting(config: dict[str, Any]) -> str:
    """The run's guarantees: "none", "central(eps=8)", "secagg+central-client-clipping(eps=8)",
    "sgd(z=1.1)" — privacy.dp's mode with its target epsilon (else its noise multiplier), and
    SecAgg+ when on."""
    parts = ["secagg"] if config.get("privacy.secagg.enabled") else []
    mode = config.get("privacy.dp.mode", "off")
    if mode != "off":
        target, z = config.get("privacy.dp.target_epsilon", 0.0), config.get("privacy.dp.noise_multiplier", 0.0)
        parts.append(f"{mode}(eps={target:g})" if target else f"{mode}(z={z:g})")
    return "+".join(parts) if parts else NO_DEFENSE


def defense_series(config: dict[str, Any]) -> tuple[str, float | None]:
    """A single-defense run's series (its setting without its strength option) and that
    strength: the frontier draws one line per series along the strength."""
    names = defense_names(config)
    option = _strength_option(config, names[0]) if len(names) == 1 else None
    if option is None:
        return defense_setting(config), None
    name = names[0]
    options = _options(config, name)
    strength = options.get(option, asdict(defense_class(name).Options())[option])
    return _label(name, {k: v for k, v in options.items() if k != option}), float(strength)


def _read_run(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(run row, round rows, attack rows); raises ValueError naming what is missing or torn."""
    def read(name: str) -> Any:
        path = folder / name
        if not path.exists():
            raise ValueError(f"no {name}")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is torn ({error.msg} at line {error.lineno})") from None

    config = read("config.json")["config"]
    status = read("status.json")
    rounds = []
    metrics_file = folder / "metrics.jsonl"
    if metrics_file.exists():
        for number, line in enumerate(metrics_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rounds.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"metrics.jsonl line {number} is torn") from None
    name = folder.name
    defenses = defense_names(config)
    row: dict[str, Any] = {
        "run": name, "folder": str(folder), "sweep": folder.parent.parent.name if folder.parent.name == "runs" else "",
        **{column: config.get(key) for column, key in SETTINGS.items()},
        "policy": policy_label(config),
        "defenses": "+".join(defenses) if defenses else NO_DEFENSE, "defense_setting": defense_setting(config),
        **dict(zip(("defense_series", "defense_strength"), defense_series(config), strict=True)),
        "privacy_setting": privacy_setting(config),
        "accountant_epsilon": (status.get("privacy_spent") or {}).get("dp_epsilon"),
        "state": status.get("state"), "error": status.get("error", ""), "rounds_done": len(rounds),
        "config": config,
    }
    if rounds:
        scored = [r for r in rounds if r.get("test_accuracy") is not None]
        row.update(
            test_accuracy=scored[-1]["test_accuracy"] if scored else None,
            test_count=scored[-1].get("test_count") if scored else None,
            zero_shot_accuracy=scored[-1].get("zero_shot_accuracy") if scored else None,
            train_loss=rounds[-1].get("train_loss"),
            kept_tokens_mean=_mean(r.get("kept_tokens_mean") for r in rounds),
            kept_tokens_share=_mean(r.get("kept_tokens_mean_share") for r in rounds),
            patches_removed_share=_mean(r.get("patches_removed_share") for r in rounds),
            mark_patches_removed_share=_mean(r.get("mark_patches_removed_share") for r in rounds),
            exclusion_ratio=_mean(r.get("exclusion_ratio_mean") for r in rounds),
            bytes_up=sum(r.get("bytes_up", 0) for r in rounds), bytes_down=sum(r.get("bytes_down", 0) for r in rounds),
            round_trips=sum(r.get("round_trips_train", 0) + r.get("round_trips_eval", 0) for r in rounds),
            round_trips_per_step=_mean(r.get("round_trips_per_step") for r in rounds),
            steps=sum(r.get("steps", 0) for r in rounds),
            wall_s=status.get("wall_s") or sum(r.get("wall_s", 0) for r in rounds),
        )
    round_rows = [{"run": name, **{k: v for k, v in r.items() if not isinstance(v, (dict, list))}} for r in rounds]
    attack_rows = []
    attack_folder = folder / ATTACK_FOLDER
    for path in sorted(attack_folder.glob("*.json")) if attack_folder.exists() else []:
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{ATTACK_FOLDER}/{path.name} is torn") from None
        label = result.get("attack", path.stem)
        base = (result.get("details") or {}).get("base_attack", label)
        attack_rows.append({"run": name, "attack": label, "base_attack": base, **result.get("metrics", {})})
    return row, round_rows, attack_rows


def _mean(values: Iterable[Any]) -> float | None:
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def load_results(*paths: str | Path) -> Results:
    runs, rounds, attacks, incomplete = [], [], [], []
    for folder in find_run_folders(paths):
        try:
            row, round_rows, attack_rows = _read_run(folder)
        except (ValueError, KeyError) as error:
            incomplete.append({"run": folder.name, "folder": str(folder), "reason": str(error)})
            continue
        runs.append(row)
        rounds.extend(round_rows)
        attacks.extend(attack_rows)
    run_frame = pd.DataFrame(runs)
    attack_frame = pd.DataFrame(attacks)
    if not attack_frame.empty:
        # Every attack row carries its run's settings, so a table groups by them directly.
        keep = ["run", "sweep", "paradigm", "profile", "policy", "threat", "defenses", "defense_setting", "defense_series",
                "defense_strength", "privacy_setting", "accountant_epsilon", "kept_tokens_mean", "test_accuracy"]
        # An attack's own copy of a run setting (the membership audits report the accountant's ε)
        # gives way to the run's, which the tables read under its own name.
        shared = [c for c in keep if c != "run" and c in run_frame and c in attack_frame]
        attack_frame = attack_frame.drop(columns=shared).merge(run_frame[[c for c in keep if c in run_frame]], on="run",
                                                               how="left")
    return Results(run_frame, pd.DataFrame(rounds), attack_frame,
                   pd.DataFrame(incomplete, columns=["run", "folder", "reason"]))


# --- what the figures need beyond the tables ----------------------------------------------------


def mia_roc(folder: str | Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(FPR, TPR) of a run's saved MIA scores (None: no MIA result with scores)."""
    path = Path(folder) / ATTACK_FOLDER / "mia.safetensors"
    if not path.exists():
        return None
    saved = load_file(str(path))
    labels, scores = saved["is_member"].numpy().astype(bool), saved["scores"].numpy()
    if labels.all() or not labels.any():
        return None
    fpr, tpr, _ = roc_curve(labels, scores)
    return fpr, tpr


def reconstructions(folder: str | Path, attack: str, count: int = 8) -> tuple[np.ndarray, np.ndarray] | None:
    """The first `count` (originals, reconstructions) of an image attack, as (N, H, W, 3) in [0, 1]."""
    path = Path(folder) / ATTACK_FOLDER / f"{attack}.safetensors"
    if not path.exists():
        return None
    saved = load_file(str(path))
    if "reconstructions" not in saved or "targets" not in saved:
        return None
    def images(tensor):
        return tensor[:count].float().clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return images(saved["targets"]), images(saved["reconstructions"])


def paradigm_table(results: Results) -> pd.DataFrame:
    """Per paradigm of runs without an attacker: final accuracy, loss, bytes, round trips, wall time."""
    runs = results.finished()
    runs = runs[runs["threat"] == threats.HONEST.name] if "threat" in runs else runs
    if runs.empty:
        return pd.DataFrame()
    table = runs[["run", "paradigm", "clients", "steps", "test_accuracy", "train_loss", "bytes_up", "bytes_down",
                  "round_trips_per_step", "wall_s"]].copy()
    table["MiB_up_per_round"] = table["bytes_up"] / runs["rounds_done"] / 2**20
    table["MiB_down_per_round"] = table["bytes_down"] / runs["rounds_done"] / 2**20
    return table.drop(columns=["bytes_up", "bytes_down"]).reset_index(drop=True)


def pruning_table(results: Results) -> pd.DataFrame:
    """Per paradigm and policy, under a passive server: accuracy, kept tokens, bytes, removal."""
    runs = results.finished()
    runs = (runs[(runs["threat"] == threats.PASSIVE.name) & (runs["defenses"] == NO_DEFENSE)] if "threat" in runs
            else runs)
    if runs.empty:
        return pd.DataFrame()
    table = runs[["paradigm", "policy", "test_accuracy", "test_count", "kept_tokens_mean", "patches_removed_share",
                  "mark_patches_removed_share", "exclusion_ratio"]].copy()
    table.insert(4, "MiB_up_per_round", runs["bytes_up"] / runs["rounds_done"] / 2**20)
    return table.sort_values(["paradigm", "kept_tokens_mean"], ascending=[True, False]).reset_index(drop=True)


def _headlines(group: pd.DataFrame, row: dict[str, Any]) -> dict[str, Any]:
    """Each attack label's headline number (from its base attack) into `row`, as <label>_<metric>."""
    for _, result in group.iterrows():
        base = result.get("base_attack")
        base = result["attack"] if not isinstance(base, str) else base
        for metric in ATTACKS.get(base).headline if base in ATTACKS else ():
            if metric in result and pd.notna(result[metric]):
                row[f"{result['attack']}_{metric}"] = result[metric]
    return row


def attack_table(results: Results) -> pd.DataFrame:
    """Per paradigm and policy of undefended runs: each attack label's headline number (image
    attacks: PSNR in dB); a labelled replay ("actinv_masked") is a column beside the plain one."""
    attacks = results.attacks
    if attacks.empty:
        return pd.DataFrame()
    rows = []
    for (paradigm, policy), group in attacks[attacks["defenses"] == NO_DEFENSE].groupby(["paradigm", "policy"]):
        rows.append(_headlines(group, {"paradigm": paradigm, "policy": policy,
                                       "kept_tokens_mean": group["kept_tokens_mean"].mean()}))
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).sort_values(["paradigm", "kept_tokens_mean"], ascending=[True, False]).reset_index(drop=True)


def defense_table(results: Results) -> pd.DataFrame:
    """Per paradigm, policy and defense setting (undefended included): test accuracy and each attack
    label's headline number, so plain and adaptive attackers ("fora", "fora_adaptive") sit side by side."""
    attacks = results.attacks
    if attacks.empty:
        return pd.DataFrame()
    rows = []
    # dropna=False: a run folder whose config names no profile still has its row.
    for (paradigm, profile, policy, setting), group in attacks.groupby(["paradigm", "profile", "policy",
                                                                         "defense_setting"], dropna=False):
        rows.append(_headlines(group, {"paradigm": paradigm, "profile": profile, "policy": policy,
                                       "defense_setting": setting, "defenses": group["defenses"].iloc[0],
                                       "test_accuracy": group["test_accuracy"].mean()}))
    return pd.DataFrame(rows).sort_values(["paradigm", "profile", "policy", "defense_setting"]).reset_index(drop=True)


# What the federated-privacy table reads of the membership attacks besides their headline.
AUDIT_METRICS = ("auc", "tpr_at_fpr_0.01", "audit_epsilon")


def federated_privacy_table(results: Results) -> pd.DataFrame:
    """Per paradigm, policy and privacy setting (privacy.dp, privacy.secagg): test accuracy, the
    accountant's epsilon, each attack label's headline number and, of the membership attacks, AUC,
    TPR at 1% FPR and the canary audit's epsilon lower bound beside the accountant's."""
    attacks = results.attacks
    if attacks.empty or "privacy_setting" not in attacks:
        return pd.DataFrame()
    rows = []
    for (paradigm, policy, setting), group in attacks.groupby(["paradigm", "policy", "privacy_setting"], dropna=False):
        row = _headlines(group, {"paradigm": paradigm, "policy": policy, "privacy_setting": setting,
                                 "test_accuracy": group["test_accuracy"].mean(),
                                 "accountant_epsilon": group["accountant_epsilon"].max()})
        for _, result in group[group["base_attack"].isin(MEMBERSHIP_ATTACKS)].iterrows():
            row.update({f"{result['attack']}_{m}": result[m] for m in AUDIT_METRICS if m in result and pd.notna(result[m])})
        rows.append(row)
    return pd.DataFrame(rows).sort_values(["paradigm", "policy", "privacy_setting"]).reset_index(drop=True)


def audit_violations(table: pd.DataFrame) -> pd.DataFrame:
    """The rows whose canary audit bounds epsilon above what the accountant spent: never, if the
    accounting and the mechanisms are right."""
    if table.empty:
        return table
    audits = [c for c in table.columns if c.endswith("_audit_epsilon")]
    over = pd.Series(False, index=table.index)
    for column in audits:
        over |= table["accountant_epsilon"].notna() & (table[column] > table["accountant_epsilon"])
    return table[over]


# The task-vector table's settings (paradigm mtv): column -> config key.
MTV_SETTINGS = {"epsilon_tv": "privacy.mtv.epsilon", "selection": "privacy.mtv.selection", "noise": "privacy.mtv.noise",
                "secagg": "privacy.secagg.enabled", "chunks": "privacy.mtv.chunks", "shots": "privacy.mtv.shots",
                "canaries": "data.canaries", "seed": "privacy.seed"}
# A task-vector setting: what a release depends on besides ε and its seed.
MTV_SETTING = ["dataset", "clients", "selection", "noise", "secagg", "chunks", "shots", "canaries"]
# The paper's DP-MTV (seed 003, VizWiz / Qwen-VL): accuracy at ε = 1 against non-private and zero-shot.
PAPER_MTV = {"epsilon_1": 0.504, "non_private": 0.55, "zero_shot": 0.35}


def mtv_table(results: Results) -> pd.DataFrame:
    """Per task-vector run: its setting (clients, noise site, selection, m, K, dataset, ε_tv), the
    ledger's total ε, test accuracy with the vector and zero-shot on the same questions, the share of
    the non-private vector's gain it keeps, the bytes a client sent, and the membership audit."""
    runs = results.finished()
    if runs.empty or "paradigm" not in runs:
        return pd.DataFrame()
    runs = runs[runs["paradigm"] == MTV.name]
    if runs.empty:
        return pd.DataFrame()
    rows = []
    for _, run in runs.iterrows():
        config = run["config"]
        row = {"run": run["run"], "sweep": run["sweep"], "dataset": run["dataset"], "clients": run["clients"],
               **{column: config.get(key) for column, key in MTV_SETTINGS.items()},
               "epsilon": run["accountant_epsilon"], "test_accuracy": run["test_accuracy"],
               "zero_shot_accuracy": run["zero_shot_accuracy"], "test_count": run["test_count"],
               "bytes_up_per_client": run["bytes_up"] / run["clients"] if run.get("bytes_up") is not None else None}
        audit = _one(results.attacks, run=run["run"], attack="mtv_mia") if not results.attacks.empty else None
        if audit is not None:
            row.update({f"audit_{m}": audit[m] for m in ("auc", "tpr_at_fpr_0.01", "audit_epsilon") if m in audit})
        rows.append(row)
    table = pd.DataFrame(rows)
    # The gain kept: against the non-private vector of the same setting (everything but ε and the
    # seed equal; the mean over its draws).
    reference = table[np.isinf(table["epsilon_tv"].astype(float))].groupby(MTV_SETTING)["test_accuracy"].mean()

    def kept(row: pd.Series) -> float | None:
        key = tuple(row[c] for c in MTV_SETTING)
        if key not in reference.index:
            return None
        gain = reference.loc[key] - row["zero_shot_accuracy"]
        return float((row["test_accuracy"] - row["zero_shot_accuracy"]) / gain) if gain > 0 else None

    table["gain_kept"] = table.apply(kept, axis=1)
    return table.sort_values([*MTV_SETTING, "epsilon_tv", "seed"]).reset_index(drop=True)


def _mtv_draws(table: pd.DataFrame, **where: Any) -> pd.DataFrame:
    """The releases (every seed) of one setting: central by default, public selection, the sweep's m and K."""
    base = {"dataset": "easyvqa", "selection": "public", "noise": "central", "chunks": 64, "shots": 4, "canaries": 0}
    return _where(table, **{**base, **where})


def mtv_claims(results: Results) -> pd.DataFrame:
    """Seed 003's claims about DP-MTV, checked on the task-vector runs (means over a setting's draws,
    privacy.seed): most of the gain kept at ε = 1, close to non-private by ε = 5, public selection at
    least as good as private, and (this system's) federated releases as good as the central one."""
    rows: list[dict[str, str]] = []
    table = mtv_table(results)

    def add(claim: str, paper: str, measured: str, holds: bool | None, reason: str) -> None:
        rows.append({"claim": claim, "paper": paper, "measured": measured, "verdict": _verdict(holds), "reason": reason})

    def acc(draws: pd.DataFrame) -> str:
        if draws.empty:
            return "—"
        mean = draws["test_accuracy"].mean()
        spread = f", {draws['test_accuracy'].min():.1%}–{draws['test_accuracy'].max():.1%}" if len(draws) > 1 else ""
        return f"{mean:.1%} ({len(draws)} draw{'s' if len(draws) > 1 else ''}{spread})"

    if table.empty:
        add("DP-MTV claims (seed 003)", "—", "—", None, "no paradigm=mtv runs")
        return pd.DataFrame(rows)
    paper_kept = (PAPER_MTV["epsilon_1"] - PAPER_MTV["zero_shot"]) / (PAPER_MTV["non_private"] - PAPER_MTV["zero_shot"])
    one, five, free = (_mtv_draws(table, clients=1, epsilon_tv=e) for e in (1.0, 5.0, float("inf")))
    # The same test questions answered zero-shot by every one of these runs.
    zero_shot = pd.concat([one, free])["zero_shot_accuracy"].mean()
    kept = None if one.empty or free.empty else (one["test_accuracy"].mean() - zero_shot) / (
        free["test_accuracy"].mean() - zero_shot)
    add("at ε = 1 most of MTV's gain over zero-shot is kept",
        f"{paper_kept:.0%} of the gain, {PAPER_MTV['epsilon_1'] / PAPER_MTV['non_private']:.0%} of the accuracy "
        "(50.4% vs 55%, zero-shot 35%)",
        "—" if kept is None else f"{kept:.0%} of the gain: {acc(one)} vs MTV {acc(free)}, zero-shot {zero_shot:.1%}",
        None if kept is None else bool(kept >= 0.5),
        "holds if the ε = 1 releases keep on average at least half of the non-private vector's gain (central, "
        "public selection)")
    interval = None if free.empty else float(accuracy_interval(free["test_accuracy"], free["test_count"]).mean())
    add("by ε = 5 DP-MTV approaches non-private MTV", "close to non-private", f"{acc(five)} vs MTV {acc(free)}",
        None if five.empty or free.empty else bool(five["test_accuracy"].mean() >= free["test_accuracy"].mean() - interval),
        "holds if the ε = 5 release is within the non-private one's 95% interval below it")
    public, private = (_mtv_draws(table, clients=1, epsilon_tv=1.0, selection=s) for s in ("public", "private"))
    add("public head selection at least as good as private", "public ≥ private", f"{acc(public)} vs {acc(private)} (ε_tv = 1)",
        None if public.empty or private.empty else bool(public["test_accuracy"].mean() >= private["test_accuracy"].mean()),
        "holds if public selection scores at least as well on average at the same ε_tv")
    for clients, noise in ((2, "central"), (4, "central"), (4, "distributed")):
        federated = _mtv_draws(table, clients=clients, epsilon_tv=1.0, noise=noise)
        add(f"{clients} clients, {noise} noise, match the central release at ε = 1", "(this system's)",
            f"{acc(federated)} vs central {acc(one)}", *_same_release(federated, one))
    audited = table.dropna(subset=["audit_audit_epsilon"]) if "audit_audit_epsilon" in table else table.iloc[:0]
    over = audited[audited["epsilon"].notna() & (audited["audit_audit_epsilon"] > audited["epsilon"])]
    add("the canary audit's ε bound stays below the ledger's ε", "(a check of the accounting)",
        ", ".join(f"ε_tv {r['epsilon_tv']:g}: audit {r['audit_audit_epsilon']:.2f}, AUC {r['audit_auc']:.2f}"
                  for _, r in audited.iterrows()) or "—",
        None if audited.empty else over.empty, "holds if no audited release's bound exceeds its ledger's ε")
    return pd.DataFrame(rows)


def _same_release(federated: pd.DataFrame, central: pd.DataFrame) -> tuple[bool | None, str]:
    """Whether two settings' releases score alike: the means within two standard errors of their
    difference, one draw's spread pooled within the two settings (the release noise decides much of
    one draw's accuracy; pooling within each keeps a difference of means out of the spread); with a
    single central draw, within its 95% test-sampling interval."""
    if federated.empty or central.empty:
        return None, "needs the federated and the central release at ε = 1"
    difference = abs(federated["test_accuracy"].mean() - central["test_accuracy"].mean())
    if len(central) > 1:
        squares = sum((len(d) - 1) * d["test_accuracy"].var() for d in (federated, central) if len(d) > 1)
        spread = math.sqrt(squares / (len(federated) + len(central) - 2))
        error = spread * math.sqrt(1 / len(federated) + 1 / len(central))
        return bool(difference <= 2 * error), ("holds if the means differ by at most two standard errors, a draw's "
                                               "spread pooled within the two settings' draws")
    interval = float(accuracy_interval(central["test_accuracy"], central["test_count"]).iloc[0])
    return bool(difference <= interval), ("holds if within the central draw's 95% test interval (one draw of each: "
                                          "the release noise's own spread is not in it)")


# What the vision-edge table reads of each image attack (position_accuracy: SARA's only).
IMAGE_METRICS = ("ssim", "psnr", "fsim", "mark_readback", "position_accuracy")


def label_attack(label: str) -> str | None:
    """The registered attack a result label replays: the label itself, else the longest registered
    name it extends with "_" (the sweeps' convention: fora_adaptive replays fora); None if neither."""
    if label in ATTACKS:
        return label
    return max((name for name in ATTACKS.names() if label.startswith(f"{name}_")), key=len, default=None)


def image_attack_table(results: Results) -> pd.DataFrame:
    """Per paradigm, profile, policy, threat and defense setting: test accuracy, kept tokens, the mean
    auxiliary image's SSIM and PSNR against the victims (what an attacker gets for recovering nothing)
    and, per image attack label, its SSIM, PSNR, FSIM, mark read-back and (SARA) position accuracy, as
    <label>_<metric>."""
    attacks = results.attacks
    if attacks.empty:
        return pd.DataFrame()
    keys = ["paradigm", "profile", "policy", "threat", "defense_setting"]
    rows = []
    for values, group in attacks[attacks["base_attack"].isin(IMAGE_ATTACKS)].groupby(keys, dropna=False):
        row = {**dict(zip(keys, values, strict=True)), "test_accuracy": group["test_accuracy"].mean(),
               "kept_tokens_mean": group["kept_tokens_mean"].mean(),
               **{f"mean_image_{m}": group[f"baseline_{m}"].mean() for m in ("ssim", "psnr")
                  if f"baseline_{m}" in group}}
        for _, result in group.iterrows():
            row.update({f"{result['attack']}_{metric}": result[metric] for metric in IMAGE_METRICS
                        if metric in result and pd.notna(result[metric])})
        rows.append(row)
    return pd.DataFrame(rows).sort_values(keys).reset_index(drop=True) if rows else pd.DataFrame()


def defense_frontier(results: Results, attack: str = "fora", metric: str = "psnr") -> pd.DataFrame:
    """Attack success against accuracy per defense and strength (the privacy-utility frontier);
    `attack` is a result label ("fora", or "fora_adaptive" for the adaptive replay)."""
    columns = ["run", "paradigm", "defenses", "defense_setting", "defense_series", "defense_strength", "policy",
               "test_accuracy", metric]
    attacks = results.attacks
    if attacks.empty or attack not in set(attacks["attack"]) or metric not in attacks:
        return pd.DataFrame(columns=columns)
    chosen = attacks[attacks["attack"] == attack]
    return chosen[columns].reset_index(drop=True)


def puri_table(results: Results, lam: float = PURI_LAMBDA) -> pd.DataFrame:
    """PURI_λ (attacks.metrics.puri) of every defended run against each image attack that replayed
    on it: its test accuracy and the attack's SSIM, PSNR and FSIM over those of the undefended run
    of the same sweep, paradigm, profile, pruning policy and threat, attacked by the same label
    (else by its base attack: an adaptive label has no undefended replay of its own)."""
    columns = ["paradigm", "profile", "policy", "threat", "defense_setting", "defense_series", "defense_strength",
               "attack", "test_accuracy", "ssim", "psnr", "fsim", "puri"]
    attacks = results.attacks
    if attacks.empty or "ssim" not in attacks:
        return pd.DataFrame(columns=columns)
    images = attacks[attacks["base_attack"].isin(IMAGE_ATTACKS) & attacks["ssim"].notna()]
    keys = ["sweep", "paradigm", "profile", "policy", "threat"]
    undefended = images[images["defenses"] == NO_DEFENSE]
    rows = []
    for _, row in images[images["defenses"] != NO_DEFENSE].iterrows():
        same = undefended[(undefended[keys] == row[keys]).all(axis=1)]
        base = same[same["attack"] == row["attack"]]
        base = base if not base.empty else same[same["attack"] == row["base_attack"]]
        if base.empty or row["test_accuracy"] is None or base["test_accuracy"].iloc[0] is None:
            continue
        reference = base.iloc[0]
        value = puri(row["test_accuracy"], reference["test_accuracy"], {m: row[m] for m in ("ssim", "psnr", "fsim")},
                     {m: reference[m] for m in ("ssim", "psnr", "fsim")}, lam)
        rows.append({**{c: row[c] for c in columns if c != "puri"}, "puri": value})
    return pd.DataFrame(rows, columns=columns)


def best_by_puri(table: pd.DataFrame) -> pd.DataFrame:
    """Per paradigm, policy, attack and defense series: the strength (ToMe's and drop's r, ...) with
    the highest PURI."""
    if table.empty:
        return table
    keys = ["paradigm", "profile", "policy", "threat", "attack", "defense_series"]
    return table.loc[table.groupby(keys)["puri"].idxmax()].sort_values(keys).reset_index(drop=True)


# Servers that only watch: their runs train as unrecorded ones do, so they count as seeds of one setting.
WATCHING_THREATS = tuple(model.name for model in threats.THREAT_MODELS if not model.hijacks)
SEED_KEYS = ["sweep", "paradigm", "profile", "policy", "defense_setting"]


def seed_spread(results: Results) -> pd.DataFrame:
    """Per sweep, paradigm, profile, policy and defense setting run at more than one LoRA seed
    (model.seed) by a watching server: the test accuracy at each seed, their mean, sample standard
    deviation and range, the run-to-run spread that differences between settings are read against."""
    if results.runs.empty or "test_accuracy" not in results.runs:
        return pd.DataFrame()
    runs = results.finished()
    runs = runs[runs["threat"].isin(WATCHING_THREATS) & runs["test_accuracy"].notna()]
    rows = []
    for values, group in runs.groupby(SEED_KEYS):
        if group["model_seed"].nunique() < 2:
            continue
        group = group.sort_values("model_seed")
        accuracy = group["test_accuracy"]
        rows.append({**dict(zip(SEED_KEYS, values, strict=True)), "seeds": [int(s) for s in group["model_seed"]],
                     "accuracies": accuracy.tolist(), "mean": accuracy.mean(), "std": accuracy.std(),
                     "min": accuracy.min(), "max": accuracy.max()})
    return pd.DataFrame(rows)


# --- the papers' claims ------------------------------------------------------------------------


def accuracy_interval(accuracy: pd.Series, count: pd.Series) -> pd.Series:
    """Half-width of the 95% normal-approximation interval of an accuracy over `count` questions."""
    return 1.96 * np.sqrt(accuracy * (1 - accuracy) / count)


def _where(frame: pd.DataFrame, **where: Any) -> pd.DataFrame:
    """The rows whose columns hold the given values (none where a column is missing)."""
    for key, value in where.items():
        if frame.empty or key not in frame:
            return frame.iloc[:0]
        frame = frame[frame[key] == value]
    return frame


def _one(frame: pd.DataFrame, **where: Any) -> pd.Series | None:
    chosen = _where(frame, **where)
    return None if chosen.empty else chosen.iloc[0]


def _verdict(holds: bool | None) -> str:
    return "not testable" if holds is None else ("holds" if holds else "does not hold")


def policy_comparisons(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of the sweeps that vary the pruning policy (loose run folders count as one sweep):
    what a comparison of policies reads. Another sweep's undefended runs (the defense sweep's
    references) used other data and attack options."""
    if frame.empty or "sweep" not in frame:
        return frame
    return frame[frame.groupby("sweep")["policy"].transform("nunique") > 1]


def claims(results: Results, paradigm: str = "usl") -> pd.DataFrame:
    """Each checkable claim of the papers: the paper's number, the number measured here on
    `paradigm`'s runs, and whether it holds, with the reason; claims these runs cannot test say why."""
    rows: list[dict[str, str]] = []
    attacks = results.attacks
    attacks = attacks[(attacks["paradigm"] == paradigm) & (attacks["defenses"] == NO_DEFENSE)] if not attacks.empty else attacks
    attacks = policy_comparisons(attacks)

    def add(claim: str, paper: str, measured: str, holds: bool | None, reason: str) -> None:
        rows.append({"claim": claim, "paper": paper, "measured": measured, "verdict": _verdict(holds), "reason": reason})

    off, dtp = _one(attacks, attack="mia", policy="off"), _one(attacks, attack="mia", policy="dtp")
    add("MIA attack success, undefended (QPriv-VL, VQA-RAD)", f"{PAPER_MIA_UNDEFENDED:.2f}",
        "—" if off is None else f"{off['attack_success']:.2f} (AUC {off['auc']:.2f})",
        None if off is None else bool(off["attack_success"] >= PAPER_MIA_UNDEFENDED - 0.1),
        "no MIA result on an unpruned run" if off is None else "holds if within 0.1 of the paper's")
    add("MIA attack success with DTP", f"{PAPER_MIA_QPRIV[0]:.2f}–{PAPER_MIA_QPRIV[1]:.2f}",
        "—" if dtp is None else f"{dtp['attack_success']:.2f}",
        None if dtp is None or off is None else bool(dtp["attack_success"] < off["attack_success"] - 0.05),
        "holds if DTP lowers success by more than 0.05 from the unpruned run")
    runs = results.finished()
    runs = runs[(runs["paradigm"] == paradigm) & (runs["defenses"] == NO_DEFENSE)] if not runs.empty else runs
    runs = policy_comparisons(runs)
    dtp_run = _one(runs, policy="dtp", threat=threats.PASSIVE.name)
    ratio = None if dtp_run is None else dtp_run.get("exclusion_ratio")
    add("sensitivity exclusion ratio of DTP", f"{PAPER_EXCLUSION_RATIO[0]:.2f} ± {PAPER_EXCLUSION_RATIO[1]:.2f}",
        "—" if ratio is None or pd.isna(ratio) else f"{ratio:.2f}",
        None if ratio is None or pd.isna(ratio) else bool(ratio >= EXCLUSION_HOLDS),
        f"holds if ≥ {EXCLUSION_HOLDS:.2f}, the paper's mean less one standard deviation (> 1: sensitive patches "
        "removed preferentially)")
    off_run = _one(runs, policy="off", threat=threats.PASSIVE.name)
    fixed = (runs[(runs["policy"].str.startswith("fixed")) & (runs["threat"] == threats.PASSIVE.name)]
             if not runs.empty else runs)
    if off_run is None or fixed.empty:
        add("competitive accuracy at about 40% of the token budget", "~40% of tokens", "—", None,
            "needs an unpruned and fixed-ratio runs")
    else:
        near = fixed.iloc[(fixed["kept_tokens_share"] - PAPER_TOKEN_BUDGET).abs().argsort()].iloc[0]
        gap = near["test_accuracy"] - off_run["test_accuracy"]
        add("competitive accuracy at about 40% of the token budget", "~40% of tokens",
            f"{near['policy']}: {100 * near['test_accuracy']:.1f}% at {100 * near['kept_tokens_share']:.0f}% of tokens "
            f"vs {100 * off_run['test_accuracy']:.1f}% unpruned", bool(gap >= -COMPETITIVE_POINTS),
            f"holds if within {100 * COMPETITIVE_POINTS:.0f} points of the unpruned run (one run's 95% interval "
            f"on its {off_run['test_count']:.0f} questions: ±"
            f"{100 * accuracy_interval(off_run['test_accuracy'], off_run['test_count']):.0f} points)")
    for attack in ("fsha", "fora"):
        trend = dtp_below_fixed_trend(attacks, attack)
        add(f"{attack.upper()} PSNR of DTP below the fixed ratios' linear trend", "below the trend",
            "—" if trend is None else f"{trend['dtp_psnr']:.2f} dB vs trend {trend['trend_psnr']:.2f} dB",
            None if trend is None else bool(trend["gap_db"] < 0),
            "needs fixed-ratio and DTP results" if trend is None else
            "the trend is a least-squares line of PSNR on mean kept tokens over the fixed ratios")
    if dtp_run is None or fixed.empty:
        add("DTP matches or beats fixed ratios while keeping more tokens", "matches or beats", "—", None,
            "needs fixed-ratio and DTP runs")
    else:
        fewer = fixed[fixed["kept_tokens_mean"] <= dtp_run["kept_tokens_mean"]]
        best = fewer["test_accuracy"].max() if not fewer.empty else None
        add("DTP matches or beats fixed ratios while keeping more tokens", "matches or beats",
            f"DTP {100 * dtp_run['test_accuracy']:.1f}% at {dtp_run['kept_tokens_mean']:.1f} tokens; best fixed ratio "
            f"keeping fewer: {'—' if best is None else f'{100 * best:.1f}%'}",
            None if best is None else bool(dtp_run["test_accuracy"] >= best - 0.01),
            "holds if DTP is within 1 point of the best fixed ratio that keeps fewer tokens (one run's 95% "
            f"interval: ±{100 * accuracy_interval(dtp_run['test_accuracy'], dtp_run['test_count']):.0f} points)")
    actinv = _one(attacks, attack="actinv", policy="off")
    add("ActInv token recall, undefended (seed 001)", f"≈{PAPER_ACTINV_RECALL:.2f}",
        "—" if actinv is None else f"{actinv['token_recall']:.2f}",
        None if actinv is None else bool(actinv["token_recall"] >= 0.9),
        "holds if ≥ 0.9; the paper's cut is after 5 LLM blocks of a text-only model")
    idlg = _one(attacks, attack="idlg", policy="off")
    add("iDLG recovers the label from the cut gradient", "analytic recovery",
        "—" if idlg is None else f"{idlg['label_accuracy']:.2f} (prior {idlg['baseline_label_accuracy']:.2f})",
        None if idlg is None else bool(idlg["label_accuracy"] > idlg["baseline_label_accuracy"] + 0.1),
        "no iDLG result: it reads USL's gradient at CB or an FL update (SL's server holds the labels)"
        if idlg is None else "holds if above the most common answer's share by more than 0.1")
    add("SARA restores shuffled tokens (seed 002)", "SSIM 0.25 → restored", "—", None,
        "the clients send their rows in patch order; token shuffling is a defense still to build")
    add("α sweep: accuracy 0.566 (α=0) vs 0.527 (α=1) on VQA-RAD", "Fig. 10", "—", None,
        "needs VQA-RAD and an α sweep on the 7B model")
    return pd.DataFrame(rows)


def _attack_at(attacks: pd.DataFrame, label: str, series: str, strength: float | None) -> pd.Series | None:
    chosen = attacks[(attacks["attack"] == label) & (attacks["defense_series"] == series)]
    if strength is not None:
        chosen = chosen[np.isclose(chosen["defense_strength"].astype(float), strength)]
    return None if chosen.empty else chosen.iloc[0]


def _best_actinv(attacks: pd.DataFrame, series: str, strength: float | None, metric: str) -> float | None:
    """The stronger of plain and masked ActInv (the attacker picks), on one defense setting."""
    values = [row[metric] for label in ("actinv", "actinv_masked")
              if (row := _attack_at(attacks, label, series, strength)) is not None and pd.notna(row.get(metric))]
    return max(values) if values else None


def defense_claims(results: Results, paradigm: str = "usl") -> pd.DataFrame:
    """Seed 001's claims about its defenses, checked on `paradigm`'s unpruned defense runs against
    the undefended runs of the same sweeps (ActInv's question-token metrics; the attacker's
    stronger of plain and masked cosine where both ran)."""
    rows: list[dict[str, str]] = []
    attacks = results.attacks
    if not attacks.empty:
        attacks = attacks[(attacks["paradigm"] == paradigm) & (attacks["threat"] == threats.PASSIVE.name)
                          & (attacks["policy"] == "off")]
        # Undefended references from the sweeps that ran defenses (same data, steps and attack options).
        attacks = attacks[attacks["sweep"].isin(set(attacks[attacks["defenses"] != NO_DEFENSE]["sweep"]))]

    def add(claim: str, paper: str, measured: str, holds: bool | None, reason: str) -> None:
        rows.append({"claim": claim, "paper": paper, "measured": measured, "verdict": _verdict(holds), "reason": reason})

    def fmt(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}"

    if attacks.empty or "defense_series" not in attacks:
        add("defense claims (seed 001)", "—", "—", None, f"no {paradigm} defense runs with attack results")
        return pd.DataFrame(rows)
    clean = _best_actinv(attacks, NO_DEFENSE, None, "token_recall")
    for series, strength, claim in (("noise", 0.1, "ActInv robust to Gaussian noise up to variance 1e-1"),
                                    ("sparsify", 0.7, "ActInv robust to element sparsification up to 0.7")):
        defended = _best_actinv(attacks, series, strength, "token_recall")
        add(claim, "precision/recall ≈ undefended", f"recall {fmt(defended)} (undefended {fmt(clean)})",
            None if defended is None or clean is None else bool(defended >= 0.8 * clean),
            "holds if the recall keeps at least 80% of the undefended run's")
    # PriPert's series carries the sweep's fixed PriPert options (e.g. iterations) in its label.
    pripert = sorted({str(x) for x in attacks["defense_series"].dropna() if str(x).startswith("pripert")
                      and "steps=" not in str(x) and "variant=l2" not in str(x)})
    sparse = _best_actinv(attacks, "sparsify", 0.5, "token_precision")
    pert = _best_actinv(attacks, pripert[0], 0.5, "token_precision") if pripert else None
    add("PriPert-L0 far below plain sparsification at sparsity 0.5", "ActInv precision 37% vs 93%",
        f"{fmt(pert)} vs {fmt(sparse)}", None if pert is None or sparse is None else bool(pert <= 0.6 * sparse),
        "holds if PriPert's precision is at most 60% of sparsification's (the paper's is 40%)")
    steps = []
    for count in (1, 2, 3):
        labels = [x for x in {str(v) for v in attacks["defense_series"].dropna()} if x.startswith("pripert")
                  and "variant=l2" not in x and (f"steps={count}" in x if count != 2 else "steps=" not in x)]
        steps.append(_best_actinv(attacks, labels[0], 0.5, "rouge_l") if labels else None)
    add("more PriPert path steps lower ActInv's ROUGE-L (sparsity 0.5)", "0.52 / 0.45 / 0.43 for 1 / 2 / 3 steps",
        " / ".join(fmt(v) for v in steps),
        None if None in steps else bool(steps[0] >= steps[1] >= steps[2] and steps[0] > steps[2]),
        "holds if ROUGE-L does not rise with the steps and falls from 1 to 3")
    for series, strength in (("sparsify", 0.5), ("sparsify", 0.9), (pripert[0] if pripert else "pripert", 0.5)):
        plain, masked = (_attack_at(attacks, label, series, strength) for label in ("actinv", "actinv_masked"))
        add(f"masked-cosine ActInv beats plain ActInv against {series} {strength:g}", "adaptive ≥ plain",
            f"recall {fmt(None if masked is None else masked['token_recall'])} vs "
            f"{fmt(None if plain is None else plain['token_recall'])}",
            None if plain is None or masked is None else bool(masked["token_recall"] >= plain["token_recall"]),
            "holds if the masked attacker recovers at least as many question tokens")
    idlg_clean = _attack_at(attacks, "idlg", NO_DEFENSE, None)
    for series, strength in (("grad_topk", 0.9), ("grad_noise", 1e-6)):
        defended = _attack_at(attacks, "idlg", series, strength)
        add(f"{series} {strength:g} at CB lowers iDLG's answer recovery", "—",
            f"{fmt(None if defended is None else defended['label_accuracy'])} vs "
            f"{fmt(None if idlg_clean is None else idlg_clean['label_accuracy'])} undefended",
            None if defended is None or idlg_clean is None
            else bool(defended["label_accuracy"] < idlg_clean["label_accuracy"] - 0.05),
            "holds if the label accuracy falls by more than 0.05")
    return pd.DataFrame(rows)


# Seed 002's margins. Reconstructions are judged by their PSNR above the mean auxiliary image's
# (baseline_psnr): on easy-VQA's flat backgrounds the mean image's SSIM (0.74 on the stamped set)
# is above nearly every reconstruction's, so SSIM cannot tell an image recovered from none, and the
# paper's shuffled 0.25 on ImageNet is the level of recovering nothing. A gain of at most
# NOTHING_DB is nothing recovered; RESTORED_SHARE of the best undefended gain is "most of it";
# placement up to NEAR_CHANCE× chance is near chance.
NOTHING_DB = 1.0
RESTORED_SHARE = 0.5
NEAR_CHANCE = 2.0
# The image attacks a passive server runs on what the vision edge sends (each label of theirs counts).
EDGE_ATTACKS = tuple(attack.name for attack in ATTACKS if attack.kind == IMAGE and attack.threat_model == PASSIVE)


def _gain(row: pd.Series, measured: str = "psnr") -> float:
    """dB above the mean image: `measured` (psnr, or SARA's without_positions_psnr) over baseline_psnr."""
    return float(row[measured] - row["baseline_psnr"])


def _edge_best(attacks: pd.DataFrame, setting: str, policy: str, labels: Sequence[str] | None = None
               ) -> tuple[float | None, str | None]:
    """The largest gain over the mean image (dB) any of `labels` (None: every label of EDGE_ATTACKS)
    reached on the run of `setting` and `policy` (the attacker picks its best), and the label that reached it."""
    best = _best_row(attacks, setting, policy, labels)
    return (None, None) if best is None else (_gain(best), str(best["attack"]))


def _best_row(attacks: pd.DataFrame, setting: str, policy: str, labels: Sequence[str] | None) -> pd.Series | None:
    """The row of `labels` (None: every label of EDGE_ATTACKS) with the largest gain over the mean image on
    the run of `setting` and `policy`."""
    chosen = attacks[(attacks["defense_setting"] == setting) & (attacks["policy"] == policy)]
    chosen = chosen[chosen["base_attack"].isin(EDGE_ATTACKS) if labels is None else chosen["attack"].isin(labels)]
    chosen = chosen.dropna(subset=["psnr", "baseline_psnr"])
    return None if chosen.empty else chosen.loc[(chosen["psnr"] - chosen["baseline_psnr"]).idxmax()]


def _sara_at(attacks: pd.DataFrame, setting: str, policy: str) -> pd.Series | None:
    """SARA on one run: the adaptive replay where it ran (it knows the edge), else the plain one."""
    for label in ("sara_adaptive", "sara"):
        row = _one(attacks, attack=label, defense_setting=setting, policy=policy)
        if row is not None:
            return row
    return None


def edge_claims(results: Results, paradigm: str = "usl", profile: str | None = None) -> pd.DataFrame:
    """Seed 002's findings about the vision edge, checked on `paradigm`'s runs of the sweep of edge
    defenses (its positionless edges labelled k1, k2, k2-adv as in sims/sweeps/vision-edge.toml), on
    `profile` (default: the one most edge-defended runs used). An image attacker's success is its
    PSNR above the mean image's (dB), the best of SARA and FORA, plain or adaptive, on each run."""
    rows: list[dict[str, str]] = []

    def add(claim: str, paper: str, measured: str, holds: bool | None, reason: str) -> None:
        rows.append({"claim": claim, "paper": paper, "measured": measured, "verdict": _verdict(holds), "reason": reason})

    def fmt(value: float | None, spec: str = "+.1f") -> str:
        return "—" if value is None or pd.isna(value) else format(value, spec)

    def placed(sara: pd.Series | None) -> str:
        if sara is None or pd.isna(sara.get("position_accuracy")):
            return "—"
        return f"{100 * sara['position_accuracy']:.1f}% of rows (chance {100 * sara['chance_position_accuracy']:.1f}%)"

    attacks = results.attacks
    if not attacks.empty:
        attacks = attacks[(attacks["paradigm"] == paradigm) & (attacks["threat"] == threats.PASSIVE.name)]
        defended = attacks[attacks["defenses"].map(lambda d: bool(set(str(d).split("+")) & set(EDGE_DEFENSES)))]
        if profile is None and not defended.empty:
            profile = str(defended["profile"].mode().iloc[0])
        attacks = attacks[attacks["sweep"].isin(set(defended["sweep"])) & (attacks["profile"] == profile)]
    if attacks.empty or "baseline_psnr" not in attacks:
        add("vision-edge claims (seed 002)", "—", "—", None, f"no {paradigm} vision-edge runs with image attacks")
        return pd.DataFrame(rows)

    fora_none, fora_shuffled = (_edge_best(attacks, s, "off", ("fora",))[0] for s in (NO_DEFENSE, "shuffle"))
    add("token shuffling defeats a decoder that reads the rows in arrival order", "SSIM 0.70 → 0.25",
        f"FORA {fmt(fora_none)} → {fmt(fora_shuffled)} dB over the mean image",
        None if fora_none is None or fora_shuffled is None
        else bool(fora_none > NOTHING_DB >= fora_shuffled),
        f"holds if FORA recovers more than {NOTHING_DB:g} dB over the mean image undefended and at most that "
        "on the shuffled run")
    best_none, by_none = _edge_best(attacks, NO_DEFENSE, "off")
    # SARA's better fit, plain or adaptive: the attacker keeps the one that recovered more.
    sara_shuffled = _best_row(attacks, "shuffle", "off", ("sara", "sara_adaptive"))
    if best_none is None or sara_shuffled is None or pd.isna(sara_shuffled.get("without_positions_psnr")):
        add("SARA restores most of it: shuffling is only apparent privacy", "most of the SSIM back", "—", None,
            "needs an image attack on the undefended run and SARA on the shuffled one")
    else:
        won, arrival = _gain(sara_shuffled), _gain(sara_shuffled, "without_positions_psnr")
        add("SARA restores most of it: shuffling is only apparent privacy", "most of the SSIM back",
            f"SARA {fmt(won)} dB over the mean image with its rows placed, {fmt(arrival)} dB in arrival order "
            f"({by_none} {fmt(best_none)} dB undefended); SARA places {placed(sara_shuffled)}",
            bool(best_none > NOTHING_DB and won > arrival and won >= RESTORED_SHARE * best_none),
            f"holds if placing the rows beats arrival order and recovers at least {RESTORED_SHARE:.0%} of the "
            "best undefended attacker's gain over the mean image")
    for label in ("k1", "k2"):
        setting = f"positionless(artifact={label})+shuffle"
        best, by = _edge_best(attacks, setting, "off")
        sara = _sara_at(attacks, setting, "off")
        add(f"the positionless edge ({label}) with shuffling keeps reconstruction low",
            "SSIM < 0.4 at every cut (0.70 undefended)",
            f"best {fmt(best)} dB over the mean image ({by or '—'}; {fmt(best_none)} undefended); "
            f"SARA places {placed(sara)}",
            None if best is None or best_none is None or sara is None or pd.isna(sara.get("position_accuracy"))
            else bool(best <= NOTHING_DB
                      and sara["position_accuracy"] <= NEAR_CHANCE * sara["chance_position_accuracy"]),
            f"holds if no attacker recovers more than {NOTHING_DB:g} dB over the mean image and SARA places at "
            f"most {NEAR_CHANCE:g}× chance")
    plain, _ = _edge_best(attacks, "positionless(artifact=k2)+shuffle", "off")
    adversarial, _ = _edge_best(attacks, "positionless(artifact=k2-adv)+shuffle", "off")
    accuracy = {label: _one(attacks, defense_setting=f"positionless(artifact={label})+shuffle", policy="off")
                for label in ("k2", "k2-adv")}
    acc = {label: None if row is None else row["test_accuracy"] for label, row in accuracy.items()}
    add("the adversarial positionless edge lowers reconstruction further, at some accuracy cost",
        "SSIM 0.370 → 0.290, accuracy 78.3% → 71.9% (ViT-B)",
        f"best {fmt(plain)} → {fmt(adversarial)} dB over the mean image, accuracy "
        f"{fmt(None if acc['k2'] is None else 100 * acc['k2'], '.1f')}% → "
        f"{fmt(None if acc['k2-adv'] is None else 100 * acc['k2-adv'], '.1f')}%",
        None if plain is None or adversarial is None else bool(adversarial < plain),
        "holds if the best attacker's gain is lower against the adversarial edge (k = 2, both shuffled); the "
        "accuracy cost is reported, not ruled on")
    dtp_none, dtp_edge = _sara_at(attacks, NO_DEFENSE, "dtp"), _sara_at(attacks, "positionless(artifact=k2)", "dtp")
    add("(no paper) SARA against QPriv-VL's pruned set: the positionless edge hides which patches DTP kept",
        "—",
        "—" if dtp_none is None or dtp_edge is None else
        f"SARA places {placed(dtp_none)} → {placed(dtp_edge)}; SARA {fmt(_gain(dtp_none))} → "
        f"{fmt(_gain(dtp_edge))} dB over the mean image",
        None if dtp_none is None or dtp_edge is None or pd.isna(dtp_edge.get("position_accuracy"))
        else bool(dtp_edge["position_accuracy"] <= NEAR_CHANCE * dtp_edge["chance_position_accuracy"]),
        f"holds if SARA places at most {NEAR_CHANCE:g}× chance of DTP's rows through the positionless edge (k = 2, "
        "unshuffled: DTP's rows arrive in patch order, and which patches they are is what is hidden)")
    return pd.DataFrame(rows)


def dtp_below_fixed_trend(attacks: pd.DataFrame, attack: str) -> dict[str, float] | None:
    """DTP's PSNR against the least-squares line of the fixed ratios' PSNR on mean kept tokens."""
    chosen = attacks[(attacks["attack"] == attack)] if not attacks.empty else attacks
    if chosen.empty or "psnr" not in chosen:
        return None
    fixed = chosen[chosen["policy"].str.startswith("fixed")].dropna(subset=["psnr", "kept_tokens_mean"])
    dtp = _one(chosen, policy="dtp")
    if dtp is None or len(fixed) < 2 or pd.isna(dtp["psnr"]):
        return None
    slope, intercept = np.polyfit(fixed["kept_tokens_mean"], fixed["psnr"], 1)
    at = float(slope * dtp["kept_tokens_mean"] + intercept)
    return {"dtp_psnr": float(dtp["psnr"]), "trend_psnr": at, "gap_db": float(dtp["psnr"] - at)}


REFERENCE = "reference"


def check_figure(figure) -> None:
    """Raise if a visible panel of a matplotlib figure shows no data (a figure that silently drew
    nothing would otherwise look like a result). Lines drawn with gid=REFERENCE (baselines,
    chance, the diagonal) do not count as data."""
    for axes in figure.axes:
        if not axes.get_visible():
            continue
        drawn = [*(line for line in axes.lines if line.get_gid() != REFERENCE), *axes.collections, *axes.images,
                 *(patch for patch in axes.patches if np.isfinite(getattr(patch, "get_height", lambda: np.nan)()))]
        if not drawn:
            raise ValueError(f"the panel {axes.get_title() or axes.get_ylabel()!r} shows no data")
