"""The claims of seed 001 (ActInv, PAF, PriPert) about defenses at the cut, judged on one paradigm's
unpruned defense runs against the undefended runs of the same sweep, every seed paired.

The attacker knows the defense: where the masked-cosine ActInv replayed beside the plain one, each
run is scored by the stronger of the two (the attacker keeps the replay that recovered more, the
same choice on every run, defended or not).
"""

from typing import Any

import pandas as pd

from analysis.claims.base import best_of_labels, one_sweep, row, run_outcomes, strength, table
from analysis.runs import NO_DEFENSE, Results
from analysis.stats import ABOVE, BELOW, Floor, Outcomes, Rule, compare, not_testable
from analysis.tables import EDGE_DEFENSES
from config import threats

ACTINV_LABELS = ("actinv", "actinv_masked")
KEEPS_SHARE = 0.8        # "robust": the defended recall keeps at least 80% of the undefended one's
PRIPERT_SHARE = 0.6      # "far below": PriPert's precision at most 60% of sparsification's (the paper's: 40%)
IDLG_DROP = 0.05
# ActInv recovers question tokens; a recall near 0 leaves a defense nothing to remove.
ACTINV_FLOOR = Floor(0.0, 0.05, "no tokens recovered (recall 0)")


def _actinv(attacks: pd.DataFrame, series: str, value: float | None, metric: str, label: str) -> Outcomes:
    return run_outcomes(strength(best_of_labels(attacks, ACTINV_LABELS, metric), series, value), metric, label)


def _pripert_series(attacks: pd.DataFrame, steps: int | None = None) -> str | None:
    """The sweep's PriPert-L0 series (its fixed options are in its label) with `steps` path steps
    (None: the default)."""
    names = sorted({str(x) for x in attacks["defense_series"].dropna() if str(x).startswith("pripert")
                    and "variant=l2" not in str(x)})
    wanted = [n for n in names if (f"steps={steps}" in n if steps is not None else "steps=" not in n)]
    return wanted[0] if wanted else None


def claims(results: Results, paradigm: str = "usl", sweep: str | None = None) -> pd.DataFrame:
    """Seed 001's claims on `paradigm`'s unpruned runs of one sweep of defenses at the cut (`sweep`,
    default the one with the most such defended runs), its undefended runs the references."""
    rows: list[dict[str, Any]] = []
    attacks = results.attacks
    if not attacks.empty and "defense_series" in attacks:
        attacks = attacks[(attacks["paradigm"] == paradigm) & (attacks["threat"] == threats.PASSIVE.name)
                          & (attacks["policy"] == "off")]
        at_cut = attacks["defenses"].map(lambda d: d != NO_DEFENSE and not set(str(d).split("+")) & set(EDGE_DEFENSES))
        (attacks,), sweep = one_sweep([attacks], attacks[at_cut], sweep)
    if attacks.empty or "defense_series" not in attacks:
        return table([row("defense claims (seed 001)", "—", not_testable(f"no {paradigm} defense runs with attack results"))])
    clean_recall = _actinv(attacks, NO_DEFENSE, None, "token_recall", "ActInv undefended")
    for series, value, claim in (("noise", 0.1, "ActInv robust to Gaussian noise up to variance 1e-1"),
                                 ("sparsify", 0.7, "ActInv robust to element sparsification up to 0.7")):
        defended = _actinv(attacks, series, value, "token_recall", f"ActInv against {series} {value:g}")
        rows.append(row(claim, "precision/recall ≈ undefended",
                        compare(clean_recall, defended, Rule(0.0, ABOVE, f"defended − {KEEPS_SHARE:g} × undefended "
                                                             "recall above 0"),
                                floor=ACTINV_FLOOR, how=lambda a, b: b - KEEPS_SHARE * a),
                        f"defended − {KEEPS_SHARE:g} × undefended recall"))
    pripert = _pripert_series(attacks)
    sparse = _actinv(attacks, "sparsify", 0.5, "token_precision", "ActInv against sparsify 0.5")
    if pripert is None:
        rows.append(row("PriPert-L0 far below plain sparsification at sparsity 0.5", "ActInv precision 37% vs 93%",
                        not_testable("no PriPert-L0 runs")))
    else:
        pert = _actinv(attacks, pripert, 0.5, "token_precision", "ActInv against PriPert 0.5")
        rows.append(row("PriPert-L0 far below plain sparsification at sparsity 0.5", "ActInv precision 37% vs 93%",
                        compare(sparse, pert, Rule(0.0, BELOW, f"PriPert − {PRIPERT_SHARE:g} × sparsify precision "
                                                         "below 0"),
                                floor=ACTINV_FLOOR, how=lambda a, b: b - PRIPERT_SHARE * a),
                        f"PriPert − {PRIPERT_SHARE:g} × sparsify precision"))
    by_steps = [(steps, _pripert_series(attacks, None if steps == 2 else steps)) for steps in (1, 2, 3)]
    if any(series is None for _, series in by_steps):
        rows.append(row("more PriPert path steps lower ActInv's ROUGE-L (sparsity 0.5)", "0.52 / 0.45 / 0.43",
                        not_testable("needs PriPert runs at 1, 2 and 3 path steps")))
    else:
        one, three = (_actinv(attacks, series, 0.5, "rouge_l", f"PriPert {steps} step(s)") for steps, series in by_steps
                      if steps != 2)
        rows.append(row("more PriPert path steps lower ActInv's ROUGE-L (sparsity 0.5)", "0.52 / 0.45 / 0.43",
                        compare(one, three, Rule(0.0, BELOW, "3 steps − 1 step below 0"), floor=ACTINV_FLOOR),
                        "3 steps − 1 step ROUGE-L"))
    for series, value in (("sparsify", 0.5), ("sparsify", 0.9), (pripert or "pripert", 0.5)):
        plain = run_outcomes(strength(attacks[attacks["attack"] == "actinv"], series, value), "token_recall",
                             f"plain ActInv against {series} {value:g}")
        masked = run_outcomes(strength(attacks[attacks["attack"] == "actinv_masked"], series, value), "token_recall",
                              f"masked ActInv against {series} {value:g}")
        rows.append(row(f"masked-cosine ActInv beats plain ActInv against {series} {value:g}", "adaptive ≥ plain",
                        compare(plain, masked, Rule(0.0, ABOVE, "masked − plain recall above 0")), "masked − plain recall"))
    idlg = attacks[attacks["attack"] == "idlg"]
    clean = run_outcomes(strength(idlg, NO_DEFENSE, None), "label_accuracy", "iDLG undefended")
    for series, value in (("grad_topk", 0.9), ("grad_noise", 1e-6)):
        defended = run_outcomes(strength(idlg, series, value), "label_accuracy", f"iDLG against {series} {value:g}")
        rows.append(row(f"{series} {value:g} at CB lowers iDLG's answer recovery", "—",
                        compare(clean, defended, Rule(-IDLG_DROP, BELOW, f"defended − undefended below −{IDLG_DROP:g}")),
                        "defended − undefended label accuracy"))
    return table(rows)
