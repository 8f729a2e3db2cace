"""A result's provenance: the commit from a clean tree (a dirty one refused, or forced and marked in
every table rendered from it), the seeds, the models' weights and the machine's load."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import provenance as P

REPOSITORY = Path(__file__).parents[2]
# benchmarks/ is a folder of scripts, not a package: they import `report` as their neighbour.
sys.path.insert(0, str(REPOSITORY / "benchmarks"))

import report  # noqa: E402

WARNING = "**Warning: measured on a dirty tree ({}): not reproducible from the commit.**"


@pytest.fixture(autouse=True)
def no_builds(monkeypatch):
    # The mini recipes and built weights are tests/benchmarks/test_results_reports.py's to check;
    # reading them imports the model code, which this file does not need.
    monkeypatch.setattr(P, "_builds", lambda: {"mini_recipe": "fedcba987654"})


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repository(tmp_path):
    root = tmp_path / "repo"
    (root / "sims").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "sims" / "run.py").write_text("x = 1\n")
    (root / "results" / "toy.json").write_text("{}\n")
    (root / ".gitignore").write_text("/runs/\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "start")
    return root


def render(stamp, folder: Path) -> list[str]:
    return report.write_markdown("toy", "Toy", "| a |\n|---|\n| 1 |", stamp, command="python toy.py",
                                 folder=folder).read_text().splitlines()


def test_a_clean_tree_stamps_its_commit_unmarked(repository, tmp_path):
    stamp = P.provenance(repository=repository)
    head = git(repository, "rev-parse", "--short=12", "HEAD")
    assert stamp["commit"] == head and stamp["dirty"] is False and "changed_paths" not in stamp
    lines = render(stamp, tmp_path)
    assert f"- commit: `{head}`" in lines
    assert not any("Warning" in line for line in lines)


def test_a_dirty_tree_is_refused_naming_the_changed_path_and_how_to_force(repository):
    (repository / "sims" / "run.py").write_text("x = 2\n")
    with pytest.raises(P.DirtyTree, match=r"1 path\(s\).*sims/run\.py.*--allow-dirty"):
        P.provenance(repository=repository)


def test_untracked_code_counts_but_results_notes_and_ignored_files_do_not(repository):
    (repository / "results" / "toy.json").write_text('{"written": "by a benchmark"}\n')
    (repository / "notes.txt").write_text("a thought\n")
    (repository / "runs").mkdir()
    (repository / "runs" / "scratch.py").write_text("")
    assert P.changed_paths(repository) == []
    (repository / "sims" / "new.py").write_text("")
    assert P.changed_paths(repository) == ["sims/new.py"]


def test_a_forced_dirty_stamp_is_marked_and_every_table_rendered_from_it_warns(repository, tmp_path):
    (repository / "sims" / "run.py").write_text("x = 2\n")
    (repository / "sims" / "new.py").write_text("")
    stamp = P.provenance(allow_dirty=True, repository=repository)
    assert stamp["dirty"] is True and stamp["commit"].endswith("+dirty")
    assert stamp["changed_paths"] == 2 and set(stamp["changed"]) == {"sims/run.py", "sims/new.py"}
    lines = render(json.loads(json.dumps(stamp)), tmp_path)  # as read back from results/<name>.json
    assert lines[2] == WARNING.format("2 changed paths")


def test_the_load_the_seeds_and_the_models_are_recorded_and_rendered(repository, tmp_path):
    stamp = P.provenance(repository=repository, seeds={"data.seed": 3, "model.seed": [0, 1]},
                         models={"mini": "mini recipe 1869deac289f, weights abcd"})
    assert len(stamp["load_average"]) == 3 and stamp["cpu_count"] == os.cpu_count()
    assert stamp["seeds"] == {"data.seed": 3, "model.seed": [0, 1]}
    lines = render(stamp, tmp_path)
    assert "- seeds: data.seed 3, model.seed [0, 1]" in lines
    assert "- models: mini `mini recipe 1869deac289f, weights abcd`" in lines
    assert any(line.startswith("- measured: ") and f"load average {stamp['load_average'][0]:.2f}, " in line
               and line.endswith(f"on {os.cpu_count()} CPUs)") for line in lines)


def test_outside_a_git_checkout_it_is_refused_and_forced_is_marked(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    with pytest.raises(P.DirtyTree, match="not a git checkout.*--allow-dirty"):
        P.provenance(repository=tmp_path)
    stamp = P.provenance(allow_dirty=True, repository=tmp_path)
    assert stamp["commit"] == "unknown+dirty"
    assert "outside a git checkout" in P.dirty_warning(stamp)


def test_older_stamps_and_a_sweeps_joined_starts_carry_the_mark(tmp_path):
    clean = {"commit": "aaaaaaaaaaaa", "dirty": False, "measured": "2026-01-01 00:00 UTC", "seeds": {"data.seed": 1}}
    dirty = {"commit": "bbbbbbbbbbbb+dirty", "dirty": True, "changed_paths": 4, "measured": "2026-01-02 00:00 UTC",
             "seeds": {"data.seed": 2}}
    merged = P.merge([clean, dirty])
    assert merged["commit"] == "aaaaaaaaaaaa, bbbbbbbbbbbb+dirty" and merged["dirty"] and merged["changed_paths"] == 4
    assert merged["seeds"] == {"data.seed": [1, 2]}
    assert merged["measured"] == "2026-01-01 00:00 UTC, the first of 2 starts"
    assert render(merged, tmp_path)[2] == WARNING.format("4 changed paths")
    # Stamps from before "dirty" was recorded, and a first start's keys with every commit joined.
    assert render({"commit": "aaaaaaaaaaaa, bbbbbbbbbbbb+dirty", "dirty": False}, tmp_path)[2] == WARNING.format(
        "changed paths not recorded")
    assert P.dirty_warning({"commit": "0cd71c900622+dirty"}) == WARNING.format("changed paths not recorded")
    assert P.dirty_warning(P.merge([clean])) is None and P.dirty_warning(None) is None


SWEEP = """
[sweep]
sim = "{sim}"
runner = "inprocess"

[fixed]
"model.profile" = "tiny"
"data.train_limit" = 12
"data.test_limit" = 4

[[grid]]
name = "seeds"
product = {{ "data.seed" = [1, 2] }}
"""


def test_a_sweep_on_a_dirty_tree_is_refused_before_it_writes_and_a_forced_start_is_marked(
        tmp_path, monkeypatch, capsys):
    from sims import sweep as S

    file, out = tmp_path / "toy.toml", tmp_path / "out"
    file.write_text(SWEEP.format(sim=REPOSITORY / "sims" / "usl_easyvqa"))
    monkeypatch.setattr(P, "changed_paths", lambda repository=P.REPOSITORY: ["sims/sweep.py"])
    assert S.main(["run", str(file), "--out", str(out), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "sims/sweep.py" in error and "--allow-dirty" in error
    assert not (out / S.SWEEP_STAMP).exists()

    sweep = S.load_sweep(file, out=out)
    S._stamp(sweep, S._provenance(sweep, allow_dirty=True))
    start = json.loads((out / S.SWEEP_STAMP).read_text())["starts"][0]
    assert start["dirty"] is True and start["commit"].endswith("+dirty") and start["changed_paths"] == 1
    assert start["seeds"]["data.seed"] == [1, 2] and start["models"] == {"tiny": "tiny: random weights (model.seed)"}
    assert render(P.merge([start]), tmp_path)[2] == WARNING.format("1 changed path")
