"""benchmarks/edge_accuracy.py on tiny: every operation the tower can run, its token count, a
positionless edge given by folder, and a bad folder refused before anything loads."""

import json
import sys
from pathlib import Path

import pytest

from sims import privacy_cli

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import edge_accuracy  # noqa: E402


def test_it_scores_each_operation_the_tower_can_run_and_a_positionless_edge(tmp_path):
    edge = tmp_path / "edge"
    assert privacy_cli.main(["positionless", "--profile", "tiny", "--stage", "random", "--steps", "1", "--rows", "4",
                             "--held-out", "2", "--out", str(edge), "--no-progress"]) == 0
    edge_accuracy.main(["--profiles", "tiny", "--limit", "8", "--positionless", f"k1={edge}", "--no-progress",
                        "--out", str(tmp_path)])
    (tiny,) = json.loads((tmp_path / "edge_accuracy.json").read_text())["profiles"]
    tokens = {row["operation"]: row["tokens"] for row in tiny["operations"]}
    # tiny: 16 patches, 1 vision block; r = 16 cannot run there and is left out.
    assert tokens == {"none": None, "shuffle": 16, "tome-4": 12, "tome-8": 8, "drop-4": 12, "drop-8": 8,
                      "positionless-k1": 16}
    assert all(0 <= row["accuracy"] <= 1 for row in tiny["operations"])
    assert "| positionless-k1 | 16 |" in (tmp_path / "edge_accuracy.md").read_text()


def test_a_folder_without_an_edge_is_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        edge_accuracy.main(["--profiles", "tiny", "--positionless", f"k1={tmp_path}", "--out", str(tmp_path)])
    assert "holds no manifest.json" in capsys.readouterr().err
