"""The federated-privacy table reads each run's guarantee and budget, and flags an audit that
bounds epsilon above what the accountant says was spent."""

import pandas as pd
import pytest

from analysis import runs, tables


def attack_rows(audit_epsilon: float, seed: int = 0) -> list[dict]:
    def row(setting, epsilon, attack, **metrics):
        return {"run": f"{setting}-s{seed}", "seed": seed, "sweep": "federated-privacy", "paradigm": "fl",
                "threat": "none", "policy": "off", "privacy_setting": setting, "test_accuracy": 0.6,
                "accountant_epsilon": epsilon, "attack": attack, "base_attack": attack, **metrics}

    return [row("none", None, "mia_loss", auc=0.9, attack_success=0.8, audit_epsilon=1.5),
            # iDLG on an FL update scores the answer tokens of the update's batch, not each sample's answer.
            row("none", None, "idlg", label_precision=1.0, top1_label_accuracy=1.0),
            row("central(eps=1)", 1.0, "mia_loss", auc=0.55, attack_success=0.52, audit_epsilon=audit_epsilon),
            row("central(eps=1)", 1.0, "idlg", label_precision=0.1, top1_label_accuracy=0.0)]


def table(audit_epsilon: float) -> pd.DataFrame:
    attacks = pd.DataFrame(attack_rows(audit_epsilon))
    return tables.federated_privacy_table(runs.Results(pd.DataFrame(), pd.DataFrame(), attacks, pd.DataFrame(), pd.DataFrame()))


def test_each_guarantee_has_its_accuracy_budget_attacks_and_audit():
    rows = table(0.2).set_index("privacy_setting")
    assert rows.loc["central(eps=1)", "accountant_epsilon"] == 1.0
    assert rows.loc["central(eps=1)", "mia_loss_audit_epsilon"] == 0.2
    assert rows.loc["none", "idlg_label_precision"] == 1.0 and rows.loc["none", "mia_loss_auc"] == 0.9
    assert tables.audit_violations(table(0.2)).empty  # the undefended run has no budget to exceed


def test_an_audit_above_the_accountant_s_epsilon_is_flagged():
    assert list(tables.audit_violations(table(1.3))["privacy_setting"]) == ["central(eps=1)"]


def test_seeds_are_summarised_not_overwritten_and_one_seed_over_the_budget_is_a_violation():
    """Three seeds of each setting: the audit's mean, least and most over them, accuracy over every
    seed's questions with its interval; the most is what must stay below the accountant's."""
    attacks = pd.DataFrame([row for seed, audit in ((0, 0.2), (1, 0.4), (2, 1.2))
                            for row in attack_rows(audit, seed)])
    outcomes = pd.DataFrame([{"run": f"{setting}-s{seed}", "seed": seed, "item": str(item),
                              "score": float(item < (80 if setting == "none" else 40))}
                             for setting in ("none", "central(eps=1)") for seed in range(3) for item in range(100)])
    result = tables.federated_privacy_table(runs.Results(pd.DataFrame(), pd.DataFrame(), attacks, outcomes, pd.DataFrame()))
    rows = result.set_index("privacy_setting")
    dp = rows.loc["central(eps=1)"]
    assert dp["seeds"] == 3 and dp["questions"] == 100 and dp["test_accuracy"] == pytest.approx(0.4)
    assert dp["accuracy_low"] <= 0.4 <= dp["accuracy_high"] < rows.loc["none", "accuracy_low"]
    assert (dp["mia_loss_audit_epsilon"], dp["mia_loss_audit_epsilon_min"], dp["mia_loss_audit_epsilon_max"]) == (
        pytest.approx(0.6), 0.2, 1.2)
    assert rows.loc["none", "mia_loss_audit_epsilon_max"] == 1.5
    # Seed 2's bound (1.2) exceeds ε = 1 though the mean (0.6) does not.
    assert list(tables.audit_violations(result)["privacy_setting"]) == ["central(eps=1)"]
    # Another sweep's runs of the same setting (a companion's) keep rows of their own.
    other = attacks.assign(sweep="memorisation-audit", run=attacks["run"] + "-m")
    both = tables.federated_privacy_table(runs.Results(pd.DataFrame(), pd.DataFrame(), pd.concat([attacks, other]),
                                                       pd.DataFrame(), pd.DataFrame()))
    assert sorted(set(both["sweep"])) == ["federated-privacy", "memorisation-audit"] and len(both) == 4


def test_the_guarantee_is_named_by_mode_budget_and_secure_aggregation():
    assert runs.privacy_setting({}) == "none"
    assert runs.privacy_setting({"privacy.dp.mode": "sgd", "privacy.dp.target_epsilon": 4.0}) == "sgd(eps=4)"
    assert runs.privacy_setting({"privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 1.5}) == "local(z=1.5)"
    assert runs.privacy_setting({"privacy.secagg.enabled": True}) == "secagg"


def cohort_results() -> runs.Results:
    """Two seeds of a poisson federation at cohorts 10 and 30 under central DP, each with its
    questions' outcomes and its update audit."""
    run_rows, outcome_rows, attack_rows_ = [], [], []
    for cohort_, accuracy in ((10, 0.25), (30, 0.75)):
        for seed in (0, 1):
            name = f"xdev-{cohort_}-s{seed}"
            run_rows.append({"run": name, "paradigm": "fl", "state": "finished", "clients": 200, "sampling": "poisson",
                             "cohort": cohort_, "privacy_setting": "central(eps=8)", "update_canaries": 1000,
                             "accountant_epsilon": 8.0, "seed": seed})
            outcome_rows += [{"run": name, "seed": seed, "item": str(item), "score": float(item < 100 * accuracy)}
                             for item in range(100)]
            attack_rows_.append({"run": name, "attack": "update_audit", "audit_epsilon": 0.5 + seed})
    round_rows = [{"run": r["run"], "round": 1, "wall_s": 2.0 * r["cohort"], "test_accuracy": None} for r in run_rows] + \
        [{"run": r["run"], "round": 2, "wall_s": 500.0, "test_accuracy": 0.5} for r in run_rows]
    return runs.Results(pd.DataFrame(run_rows), pd.DataFrame(round_rows), pd.DataFrame(attack_rows_),
                        pd.DataFrame(outcome_rows), pd.DataFrame())


def test_the_cohort_curve_has_each_cohort_s_accuracy_interval_and_audits():
    curve = tables.cohort_curve(cohort_results()).set_index("cohort")
    assert curve.loc[10, "test_accuracy"] == 0.25 and curve.loc[30, "test_accuracy"] == 0.75
    assert curve.loc[10, "accuracy_low"] < 0.25 < curve.loc[10, "accuracy_high"] < curve.loc[30, "accuracy_low"]
    assert curve.loc[30, "seeds"] == 2 and curve.loc[30, "questions"] == 100
    assert curve.loc[30, "audit_epsilon"] == 1.0 and curve.loc[30, "audit_epsilon_max"] == 1.5
    # A training round's cost, the evaluating round left out.
    assert curve.loc[10, "round_s"] == 20.0 and curve.loc[30, "round_s"] == 60.0


def test_the_cohort_is_the_expected_one_under_poisson_sampling():
    assert runs.cohort({"clients.count": 200, "clients.fraction_train": 0.15, "clients.sampling": "poisson"}) == 30
    assert runs.cohort({"clients.count": 3}) == 3
