"""results/*.md are rendered from results/*.json by the benchmark scripts, never typed by hand."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
RESULTS = BENCHMARKS.parent / "results"
# benchmarks/ is a folder of scripts, not a package: they import `report` as their neighbour.
sys.path.insert(0, str(BENCHMARKS))

import report  # noqa: E402


def test_markdown_carries_the_stamp_and_the_table(tmp_path):
    stamp = {"commit": "0123456789ab", "mini_recipe": "fedcba987654", "measured": "2026-01-01 00:00 UTC",
             "machine": "x86_64, 2 torch threads"}
    report.write_json("toy", {"provenance": stamp, "rows": [["off", 64, 0.878]]}, tmp_path)
    results = report.read_json("toy", tmp_path)
    table = report.markdown_table(
        ["policy", "kept", "accuracy"],
        [[label, kept, report.percent(accuracy)] for label, kept, accuracy in results["rows"]],
    )
    text = report.write_markdown("toy", "Toy", table, results["provenance"], command="python toy.py",
                                 folder=tmp_path).read_text()
    assert "- commit: `0123456789ab`" in text
    assert "- mini recipe: `fedcba987654`" in text
    assert "- measured: 2026-01-01 00:00 UTC (x86_64, 2 torch threads)" in text
    assert "| off | 64 | 87.8% |" in text.splitlines()


def test_a_result_without_provenance_says_so(tmp_path):
    text = report.write_markdown("old", "Old", "body", None, command="python old.py", folder=tmp_path).read_text()
    assert "- commit: `not recorded`" in text
    assert "- mini recipe: `not recorded`" in text


def test_provenance_names_the_commit_and_the_current_recipes():
    from vlm.mini import MiniRecipe
    from vlm.mini.recipe import RECIPES

    from analysis.provenance import provenance

    stamp = provenance()
    assert stamp["mini_recipe"] == MiniRecipe().fingerprint()
    # mini-positional's recipe is stamped too, and differs from mini's (its position loss).
    assert stamp["recipes"] == {name: recipe.fingerprint() for name, recipe in RECIPES.items()}
    assert stamp["recipes"]["mini-positional"] != stamp["mini_recipe"]
    assert stamp["commit"] and stamp["measured"] and stamp["machine"]


@pytest.mark.parametrize("name", ["mini_targets", "pruning_tradeoffs", "paradigm_costs", "defense_overhead",
                                  "deployment_roundtrip"])
def test_the_committed_markdown_is_what_report_renders_from_the_committed_json(name, tmp_path):
    script = importlib.import_module(name)
    rendered = script.render_report(json.loads((RESULTS / f"{name}.json").read_text()), tmp_path)
    assert rendered.read_bytes() == (RESULTS / f"{name}.md").read_bytes(), (
        f"results/{name}.md differs from its JSON: run `python benchmarks/{name}.py --report`"
    )


@pytest.mark.parametrize("name", ["paradigms", "pruning_attacks", "defenses"])
def test_the_committed_sweep_markdown_is_what_report_renders_from_the_committed_json(name, tmp_path):
    script = importlib.import_module("sweep_results")
    rendered = script.render_report(json.loads((RESULTS / f"{name}.json").read_text()), tmp_path, name)
    assert rendered.read_bytes() == (RESULTS / f"{name}.md").read_bytes(), (
        f"results/{name}.md differs from its JSON: run `python benchmarks/sweep_results.py {name.replace('_', '-')} --report`"
    )
