"""QPriv-VL's claims (seed 000: question-guided, privacy-aware visual-token pruning), each a paired
comparison of one paradigm's undefended runs with its rule and margin, and three questions the
paper did not ask (issue 40): does privacy-aware pruning leak less than efficiency pruning at equal
tokens; do attackers told the policy read more than attackers who assume random keep sets; does
leakage grow as the clients' fine-tune goes on.

The paper's numbers are on LLaVA-1.5-7B and VQA-RAD; here each claim is judged on whatever runs are
loaded (the testbed's sweeps), every seed of each setting, through analysis.stats. Membership is
judged on the sweep with the most membership results (the memorisation setting's,
sims/sweeps/pruning-mia.toml), everything else on the pruning sweep with the most runs.
"""

from typing import Any

import numpy as np
import pandas as pd

from analysis.claims.base import NOTHING_DB, accuracy_outcomes, one_sweep, row, run_outcomes, table
from analysis.runs import NO_DEFENSE, Results
from analysis.stats import ABOVE, BELOW, Floor, Outcomes, Rule, compare, estimate, floor_check, not_testable
from analysis.tables import MEMBERSHIP_ATTACKS, policy_comparisons
from config import threats

PAPER_MIA_UNDEFENDED = 0.99
PAPER_MIA_QPRIV = (0.76, 0.79)
PAPER_EXCLUSION_RATIO = (1.20, 0.18)
PAPER_TOKEN_BUDGET = 0.40
PAPER_ACTINV_RECALL = 0.99
# The margins each claim is judged with (the paper gives none).
COMPETITIVE_POINTS = 0.05   # "competitive": at most 5 points below the unpruned run
MATCH_POINTS = 0.01         # "matches or beats": at most 1 point below
MIA_DROP = 0.05             # DTP lowers MIA success by more than 0.05
MIA_NEAR_PAPER = 0.10       # undefended MIA within 0.1 of the paper's 0.99
ACTINV_RECALL = 0.90
IDLG_OVER_PRIOR = 0.10
READBACK_DROP = 0.05        # DTP's cut-probe read-back more than 5 points below another policy's
# Two policies keep "equal tokens" when their mean kept tokens differ by at most this share.
BUDGET_TOLERANCE = 0.15
# The second budget the efficiency pruners are compared at: QPriv-VL's ranking as one fixed ratio
# (the module DTP ranks with) at 25% of the tokens, where the pruners lose less accuracy.
QUARTER = 0.25
# The efficiency pruners of the token-pruning literature, run as policies (pruning.policies).
EFFICIENCY = ("random", "fastv", "sparsevlm", "dart", "visionzip")
# What an attacker told the run's policy is replayed beside (sims/sweeps/pruning-attacks.toml), per
# headline metric; and one attack's label at round 1 and at a later round.
POLICY_AWARE = (("cut probe", "cut_probe", "cut_probe_unaware", "mark_readback"),
                ("FORA", "fora", "fora_unaware", "mark_readback"), ("FORA", "fora", "fora_unaware", "psnr"))
OVER_TRAINING = (("cut probe", "cut_probe", "cut_probe-r3", "mark_readback"), ("FORA", "fora", "fora-r3", "psnr"),
                 ("ActInv", "actinv", "actinv-r3", "token_recall"))
# MIA success (or AUC) 0.5 is guessing; a reduction is measurable only from an attack clear of it.
MIA_FLOOR = Floor(0.5, 0.05, "chance (0.5)")
# The probe's read-back over the commonest digit's share: 0 is a guess.
READBACK_FLOOR = Floor(0.0, READBACK_DROP, "a guess (read-back over the commonest digit's share 0)")
PASSIVE = threats.PASSIVE.name


def _fixed_policies(runs: pd.DataFrame) -> pd.DataFrame:
    """Per fixed-ratio policy, its mean kept tokens and share over its runs."""
    fixed = runs[runs["policy"].astype(str).str.startswith("fixed")] if not runs.empty else runs
    if fixed.empty:
        return pd.DataFrame(columns=["policy", "kept_tokens_mean", "kept_tokens_share"])
    return fixed.groupby("policy")[["kept_tokens_mean", "kept_tokens_share"]].mean().reset_index()


def _trend_gaps(attacks: pd.DataFrame, attack: str) -> tuple[Outcomes, Outcomes] | None:
    """Per seed, DTP's PSNR less the least-squares line of the fixed ratios' PSNR on kept tokens at
    DTP's kept tokens; and every pruned point's gain over the mean image (to tell a floor)."""
    chosen = attacks[attacks["attack"] == attack] if not attacks.empty else attacks
    if chosen.empty or "psnr" not in chosen:
        return None
    gaps, gains = [], []
    for seed, group in chosen.groupby("seed"):
        fixed = group[group["policy"].astype(str).str.startswith("fixed")].dropna(subset=["psnr", "kept_tokens_mean"])
        dtp = group[group["policy"] == "dtp"].dropna(subset=["psnr"])
        if len(fixed) < 2 or dtp.empty:
            continue
        slope, intercept = np.polyfit(fixed["kept_tokens_mean"], fixed["psnr"], 1)
        point = dtp.iloc[0]
        gaps.append({"seed": seed, "item": "run", "score": float(point["psnr"] - (slope * point["kept_tokens_mean"] + intercept))})
        pruned = pd.concat([fixed, dtp])
        gains.extend({"seed": seed, "item": r["policy"], "score": float(r["psnr"] - r["baseline_psnr"])}
                     for _, r in pruned.iterrows() if "baseline_psnr" in r and pd.notna(r["baseline_psnr"]))
    if not gaps:
        return None
    return (Outcomes(f"{attack} DTP − fixed trend", pd.DataFrame(gaps)),
            Outcomes(f"{attack} on the pruned points", pd.DataFrame(gains, columns=["seed", "item", "score"])))


def _by_policy(attacks: pd.DataFrame, label: str, metric: str, name: str, policies: list[str]) -> Outcomes:
    """`label`'s `metric` on the runs of `policies`, each policy at each seed one item."""
    chosen = attacks[(attacks["attack"] == label) & attacks["policy"].isin(policies)] if not attacks.empty else attacks
    if chosen.empty or metric not in chosen:
        return Outcomes(name, pd.DataFrame(columns=["seed", "item", "score"]))
    frame = pd.DataFrame({"seed": chosen["seed"], "item": chosen["policy"], "score": chosen[metric]})
    return Outcomes(name, frame.dropna().reset_index(drop=True))


def _nearest(kept: pd.Series, target: float) -> str | None:
    """The label (`kept`'s index) whose budget is nearest `target`, if within BUDGET_TOLERANCE of
    it: chosen by budget, never by outcome; None where none is that near."""
    if kept.empty:
        return None
    gaps = (kept - target).abs()
    return str(gaps.idxmin()) if gaps.min() <= BUDGET_TOLERANCE * target else None


def _at_budget(runs: pd.DataFrame, name: str, tokens: float) -> str | None:
    """The label of policy `name`'s runs whose mean kept tokens are nearest `tokens`."""
    chosen = runs[runs["policy_name"] == name] if not runs.empty and "policy_name" in runs else runs.iloc[:0]
    return _nearest(chosen.groupby("policy")["kept_tokens_mean"].mean(), tokens)


def _fixed_at(fixed: pd.DataFrame, share: float) -> str | None:
    """The fixed ratio whose share of kept tokens is nearest `share`."""
    return _nearest(fixed.set_index("policy")["kept_tokens_share"], share)


def _membership(results: Results, paradigm: str) -> tuple[pd.DataFrame, str]:
    """The membership results of the sweep that holds the most of them among the sweeps varying the
    policy (undefended, `paradigm`), and the metric read: the AUC where any run has it."""
    attacks = results.attacks
    if attacks.empty:
        return attacks, "attack_success"
    chosen = policy_comparisons(attacks[(attacks["paradigm"] == paradigm) & (attacks["defenses"] == NO_DEFENSE)
                                        & (attacks.get("privacy_setting", NO_DEFENSE) == NO_DEFENSE)
                                        & attacks["base_attack"].isin(MEMBERSHIP_ATTACKS)])
    if chosen.empty:
        return chosen, "attack_success"
    (chosen,), _ = one_sweep([chosen], chosen, None)
    return chosen, "auc" if "auc" in chosen and chosen["auc"].notna().any() else "attack_success"


def _efficiency_rows(results: Results, runs: pd.DataFrame, attacks: pd.DataFrame, membership: pd.DataFrame,
                     metric: str, paradigm: str, reference: str, who: str, budget: str) -> list[dict[str, Any]]:
    """Privacy-aware pruning (`reference`'s runs, called `who`) against each efficiency pruner at the
    reference's own budget (called `budget`): the cut probe's read-back, membership, and accuracy."""
    ours = runs[runs["policy"] == reference] if not runs.empty else runs
    if ours.empty:
        return [row(f"{who} against the efficiency pruners {budget}", "not asked",
                    not_testable(f"needs {reference} runs"))]
    tokens = float(ours["kept_tokens_mean"].mean())
    probe = attacks[attacks["attack"] == "cut_probe"] if not attacks.empty else attacks
    if not probe.empty and "mark_readback" in probe:
        probe = probe.assign(over_chance=probe["mark_readback"] - probe["mark_readback_chance"])
    rows = []
    for name in EFFICIENCY:
        label = _at_budget(runs, name, tokens)
        if label is None:
            rows.append(row(f"{who} leaks less than {name} {budget}", "not asked",
                            not_testable(f"no {name} runs {budget} ({tokens:.1f} kept tokens)")))
            continue
        rows.append(row(f"{who} leaks less than {name} {budget} (cut-probe read-back)", "not asked",
                        compare(run_outcomes(probe, "over_chance", f"cut probe on {label}", policy=label),
                                run_outcomes(probe, "over_chance", f"cut probe on {reference}", policy=reference),
                                Rule(-READBACK_DROP, BELOW, f"{reference} − {label} below −{READBACK_DROP:g}"),
                                floor=READBACK_FLOOR),
                        f"{reference} − {label} read-back over a guess"))
        mia_label = _at_budget(membership.drop_duplicates("run"), name, tokens) if not membership.empty else None
        if mia_label is not None and (membership["policy"] == reference).any():
            rows.append(row(f"{who} leaks less than {name} {budget} (membership {metric})", "not asked",
                            compare(run_outcomes(membership, metric, f"MIA on {mia_label}", policy=mia_label),
                                    run_outcomes(membership, metric, f"MIA on {reference}", policy=reference),
                                    Rule(-MIA_DROP, BELOW, f"{reference} − {mia_label} below −{MIA_DROP:g}"),
                                    floor=MIA_FLOOR),
                            f"{reference} − {mia_label} {metric}"))
        rows.append(row(f"{who} answers as well as {name} {budget}", "not asked",
                        compare(accuracy_outcomes(results, label, paradigm=paradigm, policy=label, defenses=NO_DEFENSE,
                                                  threat=PASSIVE),
                                accuracy_outcomes(results, who, paradigm=paradigm, policy=reference, defenses=NO_DEFENSE,
                                                  threat=PASSIVE),
                                Rule(-MATCH_POINTS, ABOVE, f"{reference} − {label} above −{MATCH_POINTS:g}")),
                        f"{reference} − {label} accuracy"))
    return rows


def _paired_labels(attacks: pd.DataFrame, first: str, second: str, metric: str, claim: str, rule: Rule,
                   pruned: bool) -> dict[str, Any]:
    """`second` − `first` on every pruned policy both labels ran on (`pruned`), else on the
    unpruned runs, each policy at each seed one item. For PSNR, not testable where neither
    recovers anything (its gain over the mean image)."""
    ran = [set(attacks.loc[attacks["attack"] == label, "policy"]) for label in (first, second)] \
        if not attacks.empty else [set(), set()]
    policies = sorted(ran[0] & ran[1] - {"off"} if pruned else ran[0] & ran[1] & {"off"})
    if not policies:
        return row(claim, "not asked", not_testable(f"needs {first} and {second} on the same runs"))
    floors = []
    if metric == "psnr":
        for label in (first, second):
            chosen = attacks[(attacks["attack"] == label) & attacks["policy"].isin(policies)]
            gain = pd.DataFrame({"seed": chosen["seed"], "item": chosen["policy"],
                                 "score": chosen["psnr"] - chosen["baseline_psnr"]}).dropna()
            floors.append(floor_check(Outcomes(f"{label} over the mean image", gain.reset_index(drop=True)),
                                      Floor(0.0, NOTHING_DB, "the mean image's PSNR (gain 0 dB)")))
    at_floor = floors[-1] if floors and all(floors) else None
    return row(claim, "not asked",
               at_floor or compare(_by_policy(attacks, first, metric, first, policies),
                                   _by_policy(attacks, second, metric, second, policies), rule),
               f"{second} − {first} {metric} ({', '.join(policies)})")


def claims(results: Results, paradigm: str = "usl", sweep: str | None = None) -> pd.DataFrame:
    """Each of QPriv-VL's checkable claims on `paradigm`'s undefended runs without a DP guarantee of
    one sweep that varies the pruning policy (`sweep`, default the one with the most such runs)."""
    rows: list[dict[str, Any]] = []
    full, attacks = results, results.attacks
    if not attacks.empty:
        attacks = policy_comparisons(attacks[(attacks["paradigm"] == paradigm) & (attacks["defenses"] == NO_DEFENSE)
                                             & (attacks.get("privacy_setting", NO_DEFENSE) == NO_DEFENSE)])
    runs = results.honest()
    if not runs.empty:
        runs = policy_comparisons(runs[(runs["paradigm"] == paradigm) & (runs["defenses"] == NO_DEFENSE)
                                       & (runs["threat"] == PASSIVE) & (runs.get("privacy_setting", NO_DEFENSE) == NO_DEFENSE)])
    (attacks, runs, outcomes), sweep = one_sweep([attacks, runs, results.outcomes], runs, sweep)
    results = Results(runs, results.rounds, attacks, outcomes, results.incomplete)
    membership, metric = _membership(full, paradigm)
    off_mia = run_outcomes(membership, metric, "MIA on unpruned runs", policy="off")
    dtp_mia = run_outcomes(membership, metric, "MIA on DTP runs", policy="dtp")
    rows.append(row("MIA attack success, undefended (VQA-RAD)", f"{PAPER_MIA_UNDEFENDED:.2f}",
                    estimate(off_mia, Rule(PAPER_MIA_UNDEFENDED - MIA_NEAR_PAPER, ABOVE,
                                           f"{metric} interval above {PAPER_MIA_UNDEFENDED - MIA_NEAR_PAPER:.2f}")),
                    metric))
    rows.append(row("MIA attack success with DTP", f"{PAPER_MIA_QPRIV[0]:.2f}–{PAPER_MIA_QPRIV[1]:.2f}",
                    compare(off_mia, dtp_mia, Rule(-MIA_DROP, BELOW, f"DTP − unpruned below −{MIA_DROP:g}"),
                            floor=MIA_FLOOR), f"DTP − unpruned {metric}"))
    rows.append(row("sensitivity exclusion ratio of DTP above 1",
                    f"{PAPER_EXCLUSION_RATIO[0]:.2f} ± {PAPER_EXCLUSION_RATIO[1]:.2f}",
                    estimate(run_outcomes(runs, "exclusion_ratio", "DTP's exclusion ratio", policy="dtp"),
                             Rule(1.0, ABOVE, "interval above 1 (sensitive patches removed preferentially)"))))
    fixed = _fixed_policies(runs)
    if fixed.empty:
        judged = not_testable("needs unpruned and fixed-ratio runs")
        rows.append(row("competitive accuracy at about 40% of the token budget", "~40% of tokens", judged))
    else:
        # The fixed ratio chosen by its budget, before any accuracy is read.
        near = fixed.iloc[(fixed["kept_tokens_share"] - PAPER_TOKEN_BUDGET).abs().argsort()].iloc[0]
        rows.append(row("competitive accuracy at about 40% of the token budget", "~40% of tokens",
                        compare(accuracy_outcomes(results, "unpruned", paradigm=paradigm, policy="off", defenses=NO_DEFENSE, threat=PASSIVE),
                                accuracy_outcomes(results, near["policy"], paradigm=paradigm, policy=near["policy"],
                                              defenses=NO_DEFENSE, threat=PASSIVE),
                                Rule(-COMPETITIVE_POINTS, ABOVE, f"{near['policy']} − unpruned above "
                                     f"−{COMPETITIVE_POINTS:g} ({100 * near['kept_tokens_share']:.0f}% of tokens)")),
                        f"{near['policy']} − unpruned accuracy"))
    for attack in ("fsha", "fora"):
        claim = f"{attack.upper()} PSNR of DTP below the fixed ratios' linear trend"
        gaps = _trend_gaps(attacks, attack)
        if gaps is None:
            rows.append(row(claim, "below the trend", not_testable("needs fixed-ratio and DTP results")))
            continue
        gap, gains = gaps
        at_floor = floor_check(gains, Floor(0.0, NOTHING_DB, "the mean image's PSNR (gain 0 dB)"))
        rows.append(row(claim, "below the trend", at_floor or estimate(gap, Rule(0.0, BELOW, "gap interval below 0 dB")),
                        "DTP − trend (dB)"))
    dtp_runs = runs[runs["policy"] == "dtp"] if not runs.empty else runs
    fewer = fixed[fixed["kept_tokens_mean"] <= dtp_runs["kept_tokens_mean"].mean()] if not dtp_runs.empty else fixed.iloc[:0]
    if fewer.empty:
        rows.append(row("DTP matches or beats fixed ratios while keeping more tokens", "matches or beats",
                        not_testable("needs DTP runs and a fixed ratio keeping fewer tokens")))
    else:
        # The fixed ratio keeping the most tokens below DTP's: chosen by budget, never by accuracy.
        matched = fewer.sort_values("kept_tokens_mean").iloc[-1]["policy"]
        rows.append(row("DTP matches or beats fixed ratios while keeping more tokens", "matches or beats",
                        compare(accuracy_outcomes(results, matched, paradigm=paradigm, policy=matched, defenses=NO_DEFENSE, threat=PASSIVE),
                                accuracy_outcomes(results, "DTP", paradigm=paradigm, policy="dtp", defenses=NO_DEFENSE, threat=PASSIVE),
                                Rule(-MATCH_POINTS, ABOVE, f"DTP − {matched} above −{MATCH_POINTS:g}")),
                        f"DTP − {matched} accuracy"))
    actinv = attacks[attacks["attack"] == "actinv"] if not attacks.empty else attacks
    rows.append(row("ActInv token recall, undefended (seed 001)", f"≈{PAPER_ACTINV_RECALL:.2f}",
                    estimate(run_outcomes(actinv, "token_recall", "ActInv on unpruned runs", policy="off"),
                             Rule(ACTINV_RECALL, ABOVE, f"recall interval above {ACTINV_RECALL:g}"))))
    idlg = attacks[attacks["attack"] == "idlg"] if not attacks.empty else attacks
    if not idlg.empty and "baseline_label_accuracy" in idlg:
        idlg = idlg.assign(over_prior=idlg["label_accuracy"] - idlg["baseline_label_accuracy"])
        judged = estimate(run_outcomes(idlg, "over_prior", "iDLG on unpruned runs", policy="off"),
                          Rule(IDLG_OVER_PRIOR, ABOVE, f"label accuracy over the majority answer's share above "
                               f"{IDLG_OVER_PRIOR:g}"))
    else:
        judged = not_testable("no iDLG result: it reads USL's gradient at CB or an FL update (SL's server holds the labels)")
    rows.append(row("iDLG recovers the label from the cut gradient", "analytic recovery", judged, "over the prior"))
    rows.append(row("α sweep: α = 0 (sensitivity only) answers better than α = 1", "0.566 vs 0.527 (VQA-RAD, Fig. 10)",
                    compare(accuracy_outcomes(results, "DTP α=1", paradigm=paradigm, policy="dtp", defenses=NO_DEFENSE,
                                              threat=PASSIVE),
                            accuracy_outcomes(results, "DTP α=0", paradigm=paradigm, policy="dtp-a0", defenses=NO_DEFENSE,
                                              threat=PASSIVE),
                            Rule(0.0, ABOVE, "α=0 − α=1 above 0")), "α=0 − α=1 accuracy"))
    if not fixed.empty and not dtp_runs.empty:
        # The fixed ratio whose budget is nearest DTP's: the per-sample ratio against one ratio for all.
        equal = fixed.iloc[(fixed["kept_tokens_mean"] - dtp_runs["kept_tokens_mean"].mean()).abs().argsort()].iloc[0]["policy"]
        rows.append(row("DTP's per-sample ratio answers better than one fixed ratio at equal tokens", "not asked",
                        compare(accuracy_outcomes(results, equal, paradigm=paradigm, policy=equal, defenses=NO_DEFENSE,
                                                  threat=PASSIVE),
                                accuracy_outcomes(results, "DTP", paradigm=paradigm, policy="dtp", defenses=NO_DEFENSE,
                                                  threat=PASSIVE),
                                Rule(0.0, ABOVE, f"DTP − {equal} above 0")), f"DTP − {equal} accuracy"))
    rows.extend(_efficiency_rows(results, runs, attacks, membership, metric, paradigm, "dtp", "DTP", "at equal tokens"))
    quarter = _fixed_at(fixed, QUARTER)
    if quarter is not None:
        rows.extend(_efficiency_rows(results, runs, attacks, membership, metric, paradigm, quarter,
                                     f"QPriv-VL's ranking ({quarter})", f"at {QUARTER:.0%} of the tokens"))
    for attack, aware, unaware, metric_name in POLICY_AWARE:
        # The unpruned run sends every row: told or not, an attacker sees the same.
        rows.append(_paired_labels(attacks, unaware, aware, metric_name,
                                   f"an attacker told the policy reads more ({attack} {metric_name})",
                                   Rule(0.0, ABOVE, "told − random keep sets above 0"), pruned=True))
    # On the unpruned runs, where every attack reads something at round 1 (the pruned ones sit at
    # their floors from the first round on).
    for attack, first, later, metric_name in OVER_TRAINING:
        rows.append(_paired_labels(attacks, first, later, metric_name,
                                   f"leakage grows over training, unpruned ({attack} {metric_name}, round 3 − round 1)",
                                   Rule(0.0, ABOVE, "round 3 − round 1 above 0"), pruned=False))
    return table(rows)
