"""Tables of loaded runs (analysis.runs.Results): one row per setting, what the notebook and
results/*.md show. Accuracy columns come from honest runs only: a run whose server hijacked the
clients' training (FSHA) never shares a row with honest ones — its attack results sit in rows of
their own, marked by `threat`.
"""

from typing import Any

import numpy as np
import pandas as pd

from analysis.runs import NO_DEFENSE, Results
from analysis.stats import bootstrap
from attacks.base import ATTACKS, IMAGE, MEMBERSHIP
from attacks.metrics import PURI_LAMBDA, puri
from config import threats
from privacy import DEFENSES, EDGE
from vlm.paradigms import MTV

IMAGE_ATTACKS = tuple(attack.name for attack in ATTACKS if attack.kind == IMAGE)
MEMBERSHIP_ATTACKS = tuple(attack.name for attack in ATTACKS if attack.kind == MEMBERSHIP)
# The defenses that act inside the vision tower (privacy.edge).
EDGE_DEFENSES = tuple(defense.name for defense in DEFENSES if defense.stage == EDGE)


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
    """Per sweep, paradigm and policy, under a passive server: accuracy (the mean over its seeds, and
    the questions scored in all), kept tokens, bytes, removal; `seeds` the runs behind each row."""
    runs = results.finished()
    runs = (runs[(runs["threat"] == threats.PASSIVE.name) & (runs["defenses"] == NO_DEFENSE)] if "threat" in runs
            else runs)
    if runs.empty:
        return pd.DataFrame()
    runs = runs.assign(MiB_up_per_round=runs["bytes_up"] / runs["rounds_done"] / 2**20,
                       sweep=runs["sweep"] if "sweep" in runs else "")
    means = ["test_accuracy", "kept_tokens_mean", "MiB_up_per_round", "patches_removed_share",
             "mark_patches_removed_share", "exclusion_ratio"]
    table = runs.groupby(["sweep", "paradigm", "policy"], dropna=False).agg(
        seeds=("run", "count"), test_count=("test_count", "sum"), **{c: (c, "mean") for c in means}).reset_index()
    return table.sort_values(["sweep", "paradigm", "kept_tokens_mean"], ascending=[True, True, False]).reset_index(drop=True)


def _headlines(group: pd.DataFrame, row: dict[str, Any]) -> dict[str, Any]:
    """Each attack label's headline number (from its base attack) into `row`, as <label>_<metric>:
    the mean over the group's runs (its seeds)."""
    found: dict[str, list[float]] = {}
    for _, result in group.iterrows():
        base = result.get("base_attack")
        base = result["attack"] if not isinstance(base, str) else base
        for metric in ATTACKS.get(base).headline if base in ATTACKS else ():
            if metric in result and pd.notna(result[metric]):
                found.setdefault(f"{result['attack']}_{metric}", []).append(float(result[metric]))
    return {**row, **{key: float(np.mean(values)) for key, values in found.items()}}


def attack_table(results: Results) -> pd.DataFrame:
    """Per paradigm and policy of undefended runs: each attack label's headline number (image
    attacks: PSNR in dB); a labelled replay ("actinv_masked") is a column beside the plain one."""
    attacks = results.attacks
    if attacks.empty:
        return pd.DataFrame()
    rows = []
    for (paradigm, threat, policy), group in attacks[attacks["defenses"] == NO_DEFENSE].groupby(["paradigm", "threat",
                                                                                                  "policy"]):
        rows.append(_headlines(group, {"paradigm": paradigm, "threat": threat, "policy": policy,
                                       "kept_tokens_mean": group["kept_tokens_mean"].mean()}))
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).sort_values(["paradigm", "threat", "kept_tokens_mean"],
                                          ascending=[True, True, False]).reset_index(drop=True)


def defense_table(results: Results) -> pd.DataFrame:
    """Per paradigm, profile, threat, policy and defense setting (undefended included): test accuracy and each attack
    label's headline number, so plain and adaptive attackers ("fora", "fora_adaptive") sit side by side."""
    attacks = results.attacks
    if attacks.empty:
        return pd.DataFrame()
    rows = []
    # dropna=False: a run folder whose config names no profile still has its row.
    keys = ["paradigm", "profile", "threat", "policy", "defense_setting"]
    for values, group in attacks.groupby(keys, dropna=False):
        rows.append(_headlines(group, {**dict(zip(keys, values, strict=True)), "defenses": group["defenses"].iloc[0],
                                       "test_accuracy": group["test_accuracy"].mean()}))
    return pd.DataFrame(rows).sort_values(keys).reset_index(drop=True)


# What the federated-privacy table reads of the membership attacks besides their headline.
AUDIT_METRICS = ("auc", "tpr_at_fpr_0.01", "tpr_at_fpr_0.001", "audit_epsilon")


def _accuracy(results: Results, runs: pd.Series) -> dict[str, Any]:
    """Test accuracy over every question each of `runs` scored, with a 95% bootstrap interval over
    seeds, then questions (analysis.stats.bootstrap), and its n; {} when the runs scored none."""
    scored = results.outcomes[results.outcomes["run"].isin(runs)] if not results.outcomes.empty else None
    if scored is None or scored.empty:
        return {}
    accuracy = bootstrap([frame["score"].to_numpy(dtype=float) for _, frame in scored.groupby("seed")])
    return {"test_accuracy": accuracy.value, "accuracy_low": accuracy.low, "accuracy_high": accuracy.high,
            "seeds": accuracy.seeds, "questions": accuracy.items}


def federated_privacy_table(results: Results) -> pd.DataFrame:
    """Per sweep, paradigm, policy and privacy setting (privacy.dp, privacy.secagg): test accuracy
    over its seeds with its interval, the accountant's epsilon (the most any seed spent), each
    attack label's headline number and, of the membership attacks, AUC, TPR at 1% and 0.1% FPR and
    the canary audit's epsilon lower bound, each the mean over the seeds, the audit's also with its
    least and most (the most must stay below the accountant's)."""
    attacks = results.attacks
    if attacks.empty or "privacy_setting" not in attacks:
        return pd.DataFrame()
    attacks = attacks.assign(sweep=attacks["sweep"] if "sweep" in attacks else "")
    rows = []
    keys = ["sweep", "paradigm", "threat", "policy", "privacy_setting"]
    for values, group in attacks.groupby(keys, dropna=False):
        runs = group.drop_duplicates("run")
        row = _headlines(group, {**dict(zip(keys, values, strict=True)), "seeds": runs["seed"].nunique(),
                                 "test_accuracy": runs["test_accuracy"].mean(),
                                 **_accuracy(results, runs["run"]),
                                 "accountant_epsilon": group["accountant_epsilon"].max()})
        membership = group[group["base_attack"].isin(MEMBERSHIP_ATTACKS)]
        for attack, by_seed in membership.groupby("attack"):
            for metric in AUDIT_METRICS:
                measured = by_seed[metric].dropna() if metric in by_seed else pd.Series(dtype=float)
                if measured.empty:
                    continue
                row[f"{attack}_{metric}"] = float(measured.mean())
                if metric == "audit_epsilon":
                    row[f"{attack}_audit_epsilon_min"] = float(measured.min())
                    row[f"{attack}_audit_epsilon_max"] = float(measured.max())
        rows.append(row)
    return pd.DataFrame(rows).sort_values(keys).reset_index(drop=True)


# What a point of the accuracy-against-cohort curve is: its federation, its cohort, its guarantee
# and whether the server audited it with update canaries (their cost is measured beside).
COHORT_KEYS = ["clients", "sampling", "cohort", "privacy_setting", "update_canaries"]


def cohort_curve(results: Results) -> pd.DataFrame:
    """FL's accuracy against the clients a round averages, per federation and guarantee: accuracy
    over every seed's test questions with its bootstrap interval (seeds, then questions) and n, the
    accountant's epsilon, the update audit's bound at each seed (mean and max), and what a training
    round cost (its median wall seconds, the rounds that also evaluated left out)."""
    runs = results.finished()
    if runs.empty or "cohort" not in runs:
        return pd.DataFrame()
    runs = runs[runs["paradigm"] == "fl"]
    audits = rows_where(results.attacks, attack="update_audit")
    rows = []
    for values, group in runs.groupby(COHORT_KEYS, dropna=False):
        accuracy = _accuracy(results, group["run"])
        if not accuracy:
            continue
        audit = audits[audits["run"].isin(group["run"])]["audit_epsilon"] if not audits.empty else pd.Series(dtype=float)
        rounds = results.rounds[results.rounds["run"].isin(group["run"])] if not results.rounds.empty else results.rounds
        training = rounds[rounds["test_accuracy"].isna()] if "test_accuracy" in rounds else rounds
        rows.append({**dict(zip(COHORT_KEYS, values, strict=True)), **accuracy,
                     "accountant_epsilon": group["accountant_epsilon"].mean(),
                     "audit_epsilon": audit.mean() if len(audit) else None,
                     "audit_epsilon_max": audit.max() if len(audit) else None, "audits": len(audit),
                     "round_s": training["wall_s"].median() if "wall_s" in training and len(training) else None})
    return pd.DataFrame(rows).sort_values(COHORT_KEYS).reset_index(drop=True) if rows else pd.DataFrame()


def audit_violations(table: pd.DataFrame) -> pd.DataFrame:
    """The rows whose canary audit bounds epsilon above what the accountant spent, at any seed (a
    column audit_epsilon, or <attack>_audit_epsilon, and their _max over seeds): never, if the
    accounting and the mechanisms are right."""
    if table.empty:
        return table
    audits = [c for c in table.columns if c.endswith(("audit_epsilon", "audit_epsilon_max"))]
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
        audit = one_row(results.attacks, run=run["run"], attack="mtv_mia") if not results.attacks.empty else None
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
        if group["seed"].nunique() < 2:
            continue
        group = group.sort_values("seed")
        accuracy = group["test_accuracy"]
        rows.append({**dict(zip(SEED_KEYS, values, strict=True)), "seeds": [int(s) for s in group["seed"]],
                     "accuracies": accuracy.tolist(), "mean": accuracy.mean(), "std": accuracy.std(),
                     "min": accuracy.min(), "max": accuracy.max()})
    return pd.DataFrame(rows)


def accuracy_interval(accuracy: pd.Series, count: pd.Series) -> pd.Series:
    """Half-width of the 95% normal-approximation interval of an accuracy over `count` questions."""
    return 1.96 * np.sqrt(accuracy * (1 - accuracy) / count)


def rows_where(frame: pd.DataFrame, **where: Any) -> pd.DataFrame:
    """The rows whose columns hold the given values (none where a column is missing)."""
    for key, value in where.items():
        if frame.empty or key not in frame:
            return frame.iloc[:0]
        frame = frame[frame[key] == value]
    return frame


def one_row(frame: pd.DataFrame, **where: Any) -> pd.Series | None:
    chosen = rows_where(frame, **where)
    return None if chosen.empty else chosen.iloc[0]


def policy_comparisons(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of the sweeps that vary the pruning policy (loose run folders count as one sweep):
    what a comparison of policies reads. Another sweep's undefended runs (the defense sweep's
    references) used other data and attack options."""
    if frame.empty or "sweep" not in frame:
        return frame
    return frame[frame.groupby("sweep")["policy"].transform("nunique") > 1]
