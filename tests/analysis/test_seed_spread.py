"""The run-to-run spread: one setting's test accuracy over LoRA seeds, from the runs' rows."""

import pandas as pd
import pytest

from analysis import runs, tables


def run(name: str, accuracy: float, seed: int, threat: str = "passive", setting: str = "none") -> dict:
    return {"run": name, "sweep": "vision-edge", "paradigm": "usl", "profile": "mini-positional", "policy": "off",
            "defense_setting": setting, "threat": threat, "state": "finished", "test_accuracy": accuracy,
            "seed": seed}


def spread(rows: list[dict]) -> pd.DataFrame:
    return tables.seed_spread(runs.Results(pd.DataFrame(rows), pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), pd.DataFrame()))


def test_a_setting_run_at_several_seeds_by_watching_servers_reports_each_accuracy_and_their_spread():
    table = spread([run("none", 0.63, 0), run("seed-2", 0.55, 2, threat="none"), run("seed-1", 0.59, 1, threat="none"),
                    # A hijacking server trains the client otherwise: not a seed of the watched setting.
                    run("fsha-none", 0.20, 3, threat="active-fsha"),
                    # A setting at one seed has no spread to report.
                    run("shuffle", 0.60, 0, setting="shuffle")])
    assert len(table) == 1
    row = table.iloc[0]
    assert row["defense_setting"] == "none" and row["seeds"] == [0, 1, 2]
    assert row["accuracies"] == [0.63, 0.59, 0.55]
    assert row["mean"] == pytest.approx(0.59) and row["std"] == pytest.approx(0.04)
    assert (row["min"], row["max"]) == (0.55, 0.63)


def test_no_setting_at_several_seeds_gives_an_empty_table():
    assert spread([run("none", 0.63, 0), run("shuffle", 0.60, 0, setting="shuffle")]).empty
    assert spread([]).empty
