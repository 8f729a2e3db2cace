"""Honest and hijacked runs never share a row: a hijacking server's accuracy is not an honest run's."""

import pandas as pd
import pytest

from analysis import tables
from analysis.runs import Results


def attack_row(run: str, threat: str, accuracy: float, attack: str, **metrics) -> dict:
    return {"run": run, "seed": 0, "sweep": "defenses", "paradigm": "sl", "profile": "mini-scenes", "policy": "off",
            "threat": threat, "hijacked": threat == "active-fsha", "defenses": "none", "defense_setting": "none",
            "privacy_setting": "none", "accountant_epsilon": None, "kept_tokens_mean": 16.0, "test_accuracy": accuracy,
            "attack": attack, "base_attack": attack, **metrics}


ROWS = [attack_row("honest", "passive", 0.62, "fora", psnr=14.0), attack_row("honest", "passive", 0.62, "actinv",
                                                                             token_recall=0.7),
        attack_row("hijacked", "active-fsha", 0.10, "fsha", psnr=19.0)]


@pytest.mark.parametrize("table", [tables.defense_table, tables.attack_table, tables.federated_privacy_table])
def test_a_hijacked_run_has_a_row_of_its_own(table):
    frame = table(Results(pd.DataFrame(), pd.DataFrame(), pd.DataFrame(ROWS), pd.DataFrame(), pd.DataFrame()))
    assert sorted(frame["threat"]) == ["active-fsha", "passive"]
    if "test_accuracy" in frame:
        by_threat = frame.set_index("threat")["test_accuracy"]
        assert by_threat["passive"] == 0.62 and by_threat["active-fsha"] == 0.10


@pytest.mark.parametrize("table", [tables.defense_table, tables.attack_table])
def test_an_attacks_number_is_the_mean_over_the_settings_seeds(table):
    rows = [attack_row(f"s{seed}", "passive", 0.6, "fora", psnr=psnr) for seed, psnr in enumerate((12.0, 14.0, 16.0))]
    frame = table(Results(pd.DataFrame(), pd.DataFrame(), pd.DataFrame(rows), pd.DataFrame(), pd.DataFrame()))
    assert frame["fora_psnr"].tolist() == [14.0]
