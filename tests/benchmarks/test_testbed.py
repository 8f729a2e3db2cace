"""benchmarks/testbed.py: its arguments, the keep sets and probe
helpers on tiny inputs, and its markdown rendered from a small hand-made JSON (no model runs)."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.stats import wilson

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import testbed  # noqa: E402


def test_random_keep_is_seeded_per_sample_and_keeps_a_quarter():
    first = testbed.random_keep_indices("test/0/0", 64, 0.25, seed=0)
    assert len(first) == 16 and first == sorted(set(first)) and all(0 <= p < 64 for p in first)
    assert testbed.random_keep_indices("test/0/0", 64, 0.25, seed=0) == first
    assert testbed.random_keep_indices("test/0/1", 64, 0.25, seed=0) != first
    assert testbed.random_keep_indices("test/0/0", 64, 0.25, seed=1) != first
    assert len(testbed.random_keep_indices("x", 4, 0.1, seed=0)) == 1


def test_the_oracle_keeps_the_needed_patches_or_k_min_random_ones():
    assert testbed.oracle_keep_indices("a", (9, 1, 8), 64, 2, seed=0) == ([1, 8, 9], False)
    kept, fell_back = testbed.oracle_keep_indices("a", (), 64, 2, seed=0)
    assert fell_back and len(kept) == 2 and kept == sorted(set(kept))
    assert testbed.oracle_keep_indices("a", (), 64, 2, seed=0) == (kept, True)


def test_the_nearest_outside_patches_surround_the_mark():
    # A 2x2 mark in the top-left corner of an 8x8 grid: patches 0, 1, 8, 9.
    nearest = testbed.nearest_outside((0, 1, 8, 9), grid=8)
    assert len(nearest) == 4 and not set(nearest) & {0, 1, 8, 9}
    # Centre (0.5, 0.5): the four patches at distance² 2.5 (2, 10, 16, 17), by index.
    assert nearest == [2, 10, 16, 17]
    # A one-patch mark in the middle of a 4x4 grid: its four edge neighbours come first.
    assert testbed.nearest_outside((5,), grid=4) == [1, 4, 6, 9]


def test_top_k_recall_counts_the_needed_patches_among_the_best_k():
    relevance = torch.tensor([0.9, 0.1, 0.8, 0.2, 0.7])
    assert testbed.topk_recall(relevance, (0, 2)) == 1.0
    assert testbed.topk_recall(relevance, (0, 1)) == 0.5
    assert testbed.topk_recall(relevance, (1, 3, 4)) == pytest.approx(1 / 3)


def test_the_linear_probe_reads_a_separable_label_and_reports_its_interval():
    rng = np.random.default_rng(0)
    labels = np.arange(40) % 4
    centres = rng.normal(size=(4, 6)) * 10
    x = centres[labels] + rng.normal(size=(40, 6))
    result = testbed.linear_probe(x[:20], labels[:20], x[20:], labels[20:])
    assert result["value"] == 1.0 and result["n"] == 20 and result["train_n"] == 20
    assert result["ci95"][0] < 1.0 == result["ci95"][1]
    assert result["majority_rate"] == pytest.approx(0.25)
    assert result["feature_dims"] == 6


def test_intervals():
    assert testbed.share([1] * 8 + [0] * 2) == {"value": 0.8, "ci95": list(wilson(8, 10)), "n": 10}
    same = testbed.paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1], seed=0)
    assert same == {"value": 0.0, "ci95": [0.0, 0.0], "n": 4}
    difference = testbed.paired_bootstrap([1] * 50 + [0] * 50, [0] * 100, seed=0)
    assert difference["value"] == 0.5 and difference["ci95"][0] < 0.5 < difference["ci95"][1]
    scores = np.array([[0.9, 0.1, 0.2], [0.8, 0.3, 0.1]])
    labels = np.array([[1, 0, 0], [1, 0, 0]])
    auroc = testbed.auroc_by_images(scores, labels, seed=0)
    assert auroc["value"] == 1.0 and auroc["n"] == 2 and auroc["positive_patches"] == 2


@pytest.mark.parametrize("arguments,message", [
    (["--parts", "accuracy,speed"], r"--parts 'accuracy,speed': a comma-separated subset of accuracy, probes"),
    (["--parts", "probes,probes"], r"--parts 'probes,probes': .*each once"),
    (["--profile", "mini"], r"--profile 'mini': known profiles are mini-scenes, tiny"),
    (["--questions", "0"], r"--questions 0: must be at least 1"),
    (["--probe-images", "1"], r"--probe-images 1: must be at least 2"),
    (["--threads", "0"], r"--threads 0: must be at least 1"),
    (["--dtp", "/nonexistent/dtp"], r"--dtp /nonexistent/dtp: needs a prepared DTP folder"),
])
def test_bad_arguments_stop_it_before_anything_loads(arguments, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        testbed.main(["--out", str(tmp_path), *arguments])
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def measured(value, n, low=None, high=None):
    return {"value": value, "ci95": [low if low is not None else value - 0.05, high if high is not None else value + 0.05],
            "n": n}


def hand_made_results() -> dict:
    kinds = {"location": 2, "count": 2}
    accuracy = {
        "questions": 4,
        "questions_by_kind": kinds,
        "policies": {
            "full": {"accuracy": {"overall": measured(0.9, 4), "location": measured(1.0, 2), "count": measured(0.8, 2)},
                     "kept_share": {"value": 1.0, "min": 1.0, "max": 1.0, "n": 4}},
            "random_25": {"accuracy": {"overall": measured(0.5, 4), "location": measured(0.5, 2),
                                       "count": measured(0.5, 2)},
                          "kept_share": {"value": 0.25, "min": 0.25, "max": 0.25, "n": 4},
                          "loss_vs_full": {"overall": measured(0.4, 4)}},
            "oracle": {"accuracy": {"overall": measured(0.85, 4), "location": measured(1.0, 2),
                                    "count": measured(0.7, 2)},
                       "kept_share": {"value": 0.08, "min": 0.03, "max": 0.31, "n": 4},
                       "loss_vs_full": {"overall": measured(0.05, 4)}},
        },
        "question_only_baseline": {
            "rule": "per exact question text …", "fallbacks": 0, "train_rows": 10,
            "accuracy": {"overall": measured(0.4, 4), "location": measured(0.3, 2), "count": measured(0.7, 2)},
            "full_minus_baseline": {"overall": measured(0.5, 4), "location": measured(0.7, 2),
                                    "count": measured(0.1, 2)},
        },
        "oracle_rule": "needed patches", "oracle_empty_needed": 0, "random_rule": "25%", "scores": {},
    }
    probe = {"place": "vision feature layer (-2)", "features": "the mark's patch rows", "target": ">=",
             "threshold": 0.8, "train_n": 10, "majority_rate": 0.1, "feature_dims": 512, **measured(0.91, 250)}
    outside = {**probe, "features": "mean outside", "target": "<=", "threshold": 0.2, **measured(0.31, 250)}
    control = {**probe, "features": "control", "target": None, "threshold": None, **measured(0.7, 250)}
    return {
        "provenance": {"commit": "0123456789ab+dirty", "mini_recipe": "fedcba987654", "measured": "2026-01-01 00:00 UTC",
                       "machine": "x86_64, 1 torch threads", "tree": {"dirty": True, "changed_paths": 3,
                                                                      "untracked_paths": 1}},
        "settings": {"dataset": "scenes-stamped", "seed": 0, "torch_threads": 1, "cpu_count": 2},
        "model": {"profile": "mini-scenes", "stage": "vqa", "weights_digest": "abcd", "recipe_fingerprint": "3869"},
        "parts": {
            "scorer:/x/dtp-a": {"key": {}, "seconds": 5.0, "load_average_before": [1.0, 1, 1],
                                "load_average_after": [1.0, 1, 1], "result": {
                "folder": "/x/dtp-a", "settings": {"direction": "largest", "alpha": 1.0},
                "relevance_topk_recall": {**measured(0.72, 300), "chance": 0.07},
                "sensitivity_mark_auroc": measured(0.99, 250),
                "oracle_histogram": {"train": {"0.10": 5, "0.50": 5}, "held_out": {"0.10": 7, "1.00": 3}},
                "student_fit_to_oracle": {"held_out": {"count": 10, "mae": 0.2, "constant_mae": 0.25, "pearson": 0.4}}}},
            "accuracy": {"key": {}, "result": accuracy, "seconds": 12.0, "load_average_before": [1.0, 1, 1],
                         "load_average_after": [2.0, 1, 1]},
            "probes": {"key": {}, "seconds": 3.0, "load_average_before": [1.0, 1, 1], "load_average_after": [1.5, 1, 1],
                       "result": {"train_images": 10, "test_images": 250, "chance": 0.1, "handwriting": "disjoint",
                                  "probe": "logistic regression", "question_at_cut": "the first question",
                                  "mark_patches_per_image": [4],
                                  "rows": {"a_mark": probe, "b_outside": outside, "control_cut": control}}},
        },
        "memorisation": {"target_auc": 0.9, "best_point": "rows-100", "best_auc": 0.74, "reached_target": False,
                         "question_only_accuracy": 0.45, "points": [
            {"point": "rows-500", "seed": 0, "train_rows": 500, "epochs": 1, "test_accuracy": 0.81, "mia_auc": 0.52},
            {"point": "rows-100", "seed": 0, "train_rows": 100, "epochs": 8, "test_accuracy": 0.6, "mia_auc": 0.70,
             "mia_auc_low": 0.62, "mia_auc_high": 0.78, "members": 100, "non_members": 100},
            {"point": "rows-100", "seed": 1, "train_rows": 100, "epochs": 8, "test_accuracy": 0.62, "mia_auc": 0.78,
             "mia_auc_low": 0.7, "mia_auc_high": 0.86, "members": 100, "non_members": 100},
        ], "across_seeds": [
            {"point": "rows-100", "train_rows": 100, "epochs": 8.0, "seeds": [0, 1], "mia_auc_by_seed": [0.70, 0.78],
             "mia_auc": 0.74, "mia_auc_low": 0.70, "mia_auc_high": 0.78, "test_accuracy": 0.61,
             "question_only_accuracy": 0.45, "n": "2 seeds × 100 members a side"},
        ]},
    }


def test_the_report_renders_every_part_from_the_json(tmp_path):
    text = testbed.render_report(hand_made_results(), tmp_path).read_text()
    lines = text.splitlines()
    assert "- commit: `0123456789ab+dirty`" in lines
    assert "| full tokens, overall | ≥ 80.0% | 90.0% | [85.0, 95.0] | 4 | pass |" in lines
    # location clears its baseline by 70 points, count by only 10.
    assert any(line.startswith("| full − question-only baseline, location") and line.endswith("| pass |")
               for line in lines)
    assert any(line.startswith("| full − question-only baseline, count") and "**FAIL**" in line for line in lines)
    assert "| loss at random 25% keep (50.0%) | ≥ 20 pts | +40.0 pts | [+35.0, +45.0] | 4 | pass |" in lines
    assert any(line.startswith("| question-oracle keep: mean kept share") and "8.0%" in line and "pass" in line
               for line in lines)
    assert any(line.startswith("| loss at question-oracle keep") and "**FAIL**" in line for line in lines)
    assert "| (a) vision feature layer (-2): the mark's patch rows | ≥ 80.0% | 91.0% | [86.0, 96.0] | 250 | pass |" in lines
    assert any(line.startswith("| (b) vision feature layer (-2): mean outside") and "**FAIL**" in line for line in lines)
    assert any(line.startswith("| (control)") and line.endswith("| — |") for line in lines)
    # The scorer: recall below its target fails, the AUROC passes, and a ratio holding 70% of the
    # held-out samples fails the spread target while the training split's 50% passes.
    scorer = "| `dtp-a` (largest, oracle pretrained, mask pretrained, α=1) |"
    assert any(line.startswith(f"{scorer} relevance u") and "| 72.0% |" in line and "**FAIL**" in line for line in lines)
    assert any(line.startswith(f"{scorer} sensitivity s") and "| 0.990 |" in line and line.endswith("| pass |")
               for line in lines)
    assert any(line.startswith(f"{scorer} oracle ρ*: largest share of one ratio (train)") and "| 50.0% |" in line
               and line.endswith("| pass |") for line in lines)
    assert any(line.startswith(f"{scorer} oracle ρ*: largest share of one ratio (held out)") and "| 70.0% |" in line
               and "**FAIL**" in line for line in lines)
    assert "- `dtp-a` (largest, oracle pretrained, mask pretrained, α=1), held out: 0.10: 7, 1.00: 3" in lines
    assert any(line.startswith(f"{scorer} student ρ̂ against oracle ρ* (held out)") and "(guessing the mean: 0.250); "
               "Pearson r 0.40 | — | 0.200 | — | 10 | — |" in line for line in lines)
    # The memorisation points come from the other helper's dict as they are.
    assert any(line.startswith("| mean loss-MIA AUC over seeds") and "| ≥ 0.9 | 0.740 | [0.700, 0.780] (rows-100, 8 epochs) | "
               "2 seeds × 100 members a side | **FAIL** |" in line for line in lines)
    assert "| rows-100 | all | 100 | 8 | 0, 1 | 0.700, 0.780 | 0.740 | [0.700, 0.780] | 61.0% | 45.0% | 2 seeds × 100 members a side |" in lines
    assert "| point | seed | train_rows | epochs | test_accuracy | mia_auc | mia_auc_low | mia_auc_high | members | non_members |" in lines
    assert "| rows-100 | 1 | 100 | 8 | 0.620 | 0.780 | 0.700 | 0.860 | 100 | 100 |" in lines
    assert "| accuracy | 12 | 1.00 | 2.00 |" in lines


def test_a_json_without_parts_renders_not_measured_everywhere(tmp_path):
    text = testbed.render_report({}, tmp_path).read_text()
    assert text.count("not measured") >= 3
    assert "| none given (--dtp DIR) | — | — | not measured | — | — | — |" in text
    assert "Not measured (`--parts memorisation`" in text


def test_report_only_rerenders_the_stored_json(tmp_path):
    (tmp_path / "testbed.json").write_text(json.dumps(hand_made_results()))
    testbed.main(["--report", "--out", str(tmp_path)])
    assert (tmp_path / "testbed.md").read_text() == testbed.render_report(hand_made_results(), tmp_path).read_text()


def test_the_committed_markdown_is_what_report_renders_from_the_committed_json(tmp_path):
    results = Path(__file__).parents[2] / "results"
    if not (results / "testbed.json").is_file():
        pytest.skip("results/testbed.json not measured yet")
    rendered = testbed.render_report(json.loads((results / "testbed.json").read_text()), tmp_path)
    assert rendered.read_bytes() == (results / "testbed.md").read_bytes(), (
        "results/testbed.md differs from its JSON: run `python benchmarks/testbed.py --report`"
    )


def test_it_measures_on_tiny_saves_each_part_and_keeps_finished_parts_on_a_rerun(tmp_path, capsys):
    arguments = ["--profile", "tiny", "--questions", "24", "--probe-images", "12", "--out", str(tmp_path),
                 "--no-progress"]
    testbed.main([*arguments, "--parts", "accuracy,probes"])
    results = json.loads((tmp_path / "testbed.json").read_text())
    accuracy = results["parts"]["accuracy"]["result"]
    assert accuracy["questions"] == 24 and set(accuracy["policies"]) == {"full", "random_25", "oracle"}
    assert all(len(scores) == 24 for scores in accuracy["scores"].values())
    assert accuracy["policies"]["random_25"]["kept_share"]["value"] == 0.25
    probes = results["parts"]["probes"]["result"]
    assert probes["train_images"] == probes["test_images"] == 12
    assert set(probes["rows"]) == {"a_mark_patches", "b_outside_mean", "b_outside_nearest", "c_cut_visual_mean",
                                   "c_cut_visual_nearest", "c_cut_text_mean", "control_cut_mark_unpruned"}
    assert results["model"]["weights_digest"] == "random weights (seed 0)"
    assert results["provenance"]["dirty"] is False and results["provenance"]["seeds"] == {"seed": 0}
    assert results["provenance"]["models"] == {"tiny": "tiny: random weights (model.seed)"}
    assert testbed.render_report(results, tmp_path).read_bytes() == (tmp_path / "testbed.md").read_bytes()
    capsys.readouterr()
    testbed.main([*arguments, "--parts", "accuracy"])
    assert "accuracy: already measured, kept" in capsys.readouterr().out
    again = json.loads((tmp_path / "testbed.json").read_text())
    assert again["parts"]["accuracy"] == results["parts"]["accuracy"]
    assert again["parts"]["probes"] == results["parts"]["probes"]
    # A part measured on other weights is dropped on the next run, not shown beside this model's.
    stale = {**again["parts"]["probes"], "key": {**again["parts"]["probes"]["key"], "weights_digest": "0ther"}}
    (tmp_path / "testbed.json").write_text(json.dumps({**again, "parts": {**again["parts"], "scorer:/x": stale}}))
    testbed.main([*arguments, "--parts", "accuracy"])
    assert "scorer:/x: measured on weights 0ther, dropped" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "testbed.json").read_text())["parts"]) == {"accuracy", "probes"}
