"""`qpriv-privacy mtv` on the tiny profile: every method measured and reported with its ledger, a
rerun resumes instead of recomputing, and bad settings are refused before any model loads."""

import json
import math

import pytest

from sims import mtv
from sims.privacy_cli import main

TINY_ARGS = ["mtv", "--profile", "tiny", "--stage", "random", "--private", "30", "--public", "12", "--test", "8",
             "--chunks", "6", "--shots", "2", "--epsilons", "2,inf", "--reinforce-steps", "2", "--no-progress"]


def test_every_method_is_measured_with_its_cost_and_a_rerun_resumes(tmp_path, monkeypatch):
    out = tmp_path / "mtv"
    assert main([*TINY_ARGS, "--out", str(out)]) == 0
    results = json.loads((out / "mtv.json").read_text())
    methods = results["methods"]
    assert list(methods) == ["zero-shot", "2-shot in context", "MTV (ε = inf)", "DP-MTV (ε_tv = 2)"]
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in methods.values())
    assert methods["DP-MTV (ε_tv = 2)"]["ledger"]["epsilon"] == pytest.approx(2.0)
    assert math.isinf(methods["MTV (ε = inf)"]["ledger"]["epsilon"])
    assert results["clip"] > 0  # --clip auto, from the public chunks
    assert {p.name for p in out.iterdir()} >= {"mtv.md", "mtv.png", "task_vector-eps2.pt", "task_vector-epsinf.pt"}
    assert "| DP-MTV (ε_tv = 2) |" in (out / "mtv.md").read_text()

    def never(*_, **__):
        raise AssertionError("a finished method was recomputed")

    monkeypatch.setattr(mtv, "build_task_vector", never)
    assert main([*TINY_ARGS, "--out", str(out)]) == 0
    assert json.loads((out / "mtv.json").read_text())["methods"] == methods


@pytest.mark.parametrize(("extra", "message"), [
    (["--chunks", "11"], "--chunks 11: at most 10: 11 chunks of 2 demonstrations"),
    (["--epsilons", "1,-2"], "--epsilons '1,-2': comma-separated numbers > 0, or inf"),
    (["--clip", "wide"], "--clip 'wide': a number > 0, or auto"),
    (["--delta", "0.5"], "--delta 0.5: < 1/30"),
])
def test_bad_settings_are_refused_naming_the_flag(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setattr(mtv, "load_client", lambda *_: pytest.fail("the model loaded before the check"))
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY_ARGS, "--out", str(tmp_path), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_paper_scale_model_fails_fast_saying_how_to_supply_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert main([*TINY_ARGS, "--profile", "llava-1.5-7b", "--stage", "base", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "llava-hf/llava-1.5-7b-hf" in error and "hf download" in error
