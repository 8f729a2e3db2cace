"""The federated-privacy table reads each run's guarantee and budget, and flags an audit that
bounds epsilon above what the accountant says was spent."""

import pandas as pd

from analysis import runs, tables


def attack_rows(audit_epsilon: float) -> list[dict]:
    def row(setting, epsilon, attack, **metrics):
        return {"run": setting, "paradigm": "fl", "threat": "none", "policy": "off", "privacy_setting": setting, "test_accuracy": 0.6,
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


def test_the_guarantee_is_named_by_mode_budget_and_secure_aggregation():
    assert runs.privacy_setting({}) == "none"
    assert runs.privacy_setting({"privacy.dp.mode": "sgd", "privacy.dp.target_epsilon": 4.0}) == "sgd(eps=4)"
    assert runs.privacy_setting({"privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 1.5}) == "local(z=1.5)"
    assert runs.privacy_setting({"privacy.secagg.enabled": True}) == "secagg"
