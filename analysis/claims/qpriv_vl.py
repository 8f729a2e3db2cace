"""QPriv-VL's claims (seed 000: question-guided, privacy-aware visual-token pruning), each a paired
comparison of one paradigm's undefended runs with its rule and margin.

The paper's numbers are on LLaVA-1.5-7B and VQA-RAD; here each claim is judged on whatever runs are
loaded (the testbed's sweeps), every seed of each setting, through analysis.stats.
"""

from typing import Any

import numpy as np
import pandas as pd

from analysis.claims.base import NOTHING_DB, accuracy_outcomes, one_sweep, row, run_outcomes, table
from analysis.runs import NO_DEFENSE, Results
from analysis.stats import ABOVE, BELOW, Floor, Outcomes, Rule, compare, estimate, floor_check, not_testable
from analysis.tables import policy_comparisons
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
# MIA success 0.5 is guessing; a reduction is measurable only from an attack clear of it.
MIA_FLOOR = Floor(0.5, 0.05, "chance (success 0.5)")
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


def claims(results: Results, paradigm: str = "usl", sweep: str | None = None) -> pd.DataFrame:
    """Each of QPriv-VL's checkable claims on `paradigm`'s undefended runs without a DP guarantee of
    one sweep that varies the pruning policy (`sweep`, default the one with the most such runs)."""
    rows: list[dict[str, Any]] = []
    attacks = results.attacks
    if not attacks.empty:
        attacks = policy_comparisons(attacks[(attacks["paradigm"] == paradigm) & (attacks["defenses"] == NO_DEFENSE)
                                             & (attacks.get("privacy_setting", NO_DEFENSE) == NO_DEFENSE)])
    runs = results.honest()
    if not runs.empty:
        runs = policy_comparisons(runs[(runs["paradigm"] == paradigm) & (runs["defenses"] == NO_DEFENSE)
                                       & (runs["threat"] == PASSIVE) & (runs.get("privacy_setting", NO_DEFENSE) == NO_DEFENSE)])
    (attacks, runs, outcomes), sweep = one_sweep([attacks, runs, results.outcomes], runs, sweep)
    results = Results(runs, results.rounds, attacks, outcomes, results.incomplete)
    mia = attacks[attacks["attack"] == "mia"] if not attacks.empty else attacks
    off_mia = run_outcomes(mia, "attack_success", "MIA on unpruned runs", policy="off")
    dtp_mia = run_outcomes(mia, "attack_success", "MIA on DTP runs", policy="dtp")
    rows.append(row("MIA attack success, undefended (VQA-RAD)", f"{PAPER_MIA_UNDEFENDED:.2f}",
                    estimate(off_mia, Rule(PAPER_MIA_UNDEFENDED - MIA_NEAR_PAPER, ABOVE,
                                           f"success interval above {PAPER_MIA_UNDEFENDED - MIA_NEAR_PAPER:.2f}"))))
    rows.append(row("MIA attack success with DTP", f"{PAPER_MIA_QPRIV[0]:.2f}–{PAPER_MIA_QPRIV[1]:.2f}",
                    compare(off_mia, dtp_mia, Rule(-MIA_DROP, BELOW, f"DTP − unpruned below −{MIA_DROP:g}"),
                            floor=MIA_FLOOR), "DTP − unpruned"))
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
    rows.append(row("α sweep: accuracy 0.566 (α=0) vs 0.527 (α=1) on VQA-RAD", "Fig. 10",
                    not_testable("needs VQA-RAD and an α sweep on the 7B model")))
    return table(rows)
