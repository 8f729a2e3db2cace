"""Run folders load with what a verdict needs: each run's seed, whether its server hijacked it, the
start that made it, and its per-question outcomes; a torn outcomes file is reported, not raised."""

import json

import pytest

from analysis.claims.base import accuracy_outcomes
from analysis.runs import load_results
from sims.inprocess import run_in_process
from training.protocol import OUTCOMES_FILE


def test_per_question_outcomes_load_with_their_runs_settings(run_config, tmp_path):
    folders = [run_in_process(run_config(paradigm="usl", **{"model.seed": seed, "output.name": f"usl-s{seed}",
                                                            "data.test_limit": 6, "eval.every": 1}))
               for seed in (0, 1)]
    results = load_results(*(folder.path for folder in folders))
    assert sorted(results.runs["seed"]) == [0, 1] and not results.runs["hijacked"].any()
    outcomes = results.outcomes
    assert len(outcomes) == 12 and set(outcomes["paradigm"]) == {"usl"}
    for _, run in results.runs.iterrows():
        mine = outcomes[outcomes["run"] == run["run"]]
        assert mine["score"].mean() == pytest.approx(run["test_accuracy"])
    chosen = accuracy_outcomes(results, paradigm="usl")
    assert chosen.seeds == [0, 1] and chosen.items == 6


def test_a_torn_outcomes_file_marks_the_run_incomplete(run_config):
    folder = run_in_process(run_config(paradigm="cl", **{"clients.count": 1, "data.test_limit": 4, "eval.every": 1}))
    with (folder.path / OUTCOMES_FILE).open("a") as file:
        file.write('{"round": 2, "scores": [1.0')
    results = load_results(folder.path)
    assert results.runs.empty and f"{OUTCOMES_FILE} line 2 is torn" in results.incomplete["reason"].iloc[0]


def test_a_sweeps_runs_carry_the_commit_of_the_start_that_made_them(run_config, tmp_path):
    sweep = tmp_path / "sweep"
    folder = run_in_process(run_config(paradigm="cl", **{"clients.count": 1, "output.root": str(sweep / "runs"), "output.name": "point-a"}))
    (sweep / "sweep.json").write_text(json.dumps({"starts": [
        {"commit": "abc123", "points": ["point-a"]}, {"commit": "def456", "dirty": True, "points": ["point-a", "b"]}]}))
    results = load_results(sweep)
    run = results.runs.set_index("run").loc[folder.path.name]
    assert run["start"] == "abc123" and not run["dirty"] and run["sweep"] == "sweep"
