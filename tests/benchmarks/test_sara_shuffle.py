"""benchmarks/sara_shuffle.py end to end on tiny with a few epochs: what it measures, that its
markdown is rendered from its JSON, and that bad arguments stop it before anything loads."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import sara_shuffle  # noqa: E402

FEW_EPOCHS = ["--sara-option", "tpp_epochs=2", "--sara-option", "mae_epochs=1", "--sara-option", "decoder_epochs=2"]


def test_it_measures_the_three_reads_the_positions_and_the_probes_on_tiny(tmp_path):
    sara_shuffle.main(["--profiles", "tiny", "--aux", "24", "--victims", "6", "--probe-images", "16",
                       "--probes", "linear", "--no-progress", "--out", str(tmp_path), *FEW_EPOCHS])
    results = json.loads((tmp_path / "sara_shuffle.json").read_text())
    (tiny,) = results["profiles"]
    assert set(tiny["reconstruction"]) == {"aligned", "shuffled", "sara"}
    assert all(0 <= m["ssim"] <= 1 for m in tiny["reconstruction"].values())
    assert tiny["positions"]["chance_position_accuracy"] == pytest.approx(1 / 16)
    assert [q["place"] for q in tiny["probes"]] == [
        "vision embeddings", "vision layer 1", "cut 2 (patch order)", "cut 2 (shuffled order)"]
    assert tiny["sara_options"]["stage_inputs"] == "paper" and tiny["sara_options"]["tpp_epochs"] == 2
    assert (tmp_path / "sara_shuffle.png").stat().st_size > 0
    markdown = (tmp_path / "sara_shuffle.md").read_bytes()
    assert sara_shuffle.render_report(results, tmp_path).read_bytes() == markdown


@pytest.mark.parametrize("arguments,message", [
    (["--aux", "1"], "--aux 1: must be at least 2"),
    (["--profiles", "mini,llava-13b"], "--profiles 'mini,llava-13b': known profiles are"),
    (["--probes", "cnn"], "--probes 'cnn': a comma-separated subset of linear, mlp"),
    (["--sara-option", "stage_inputs=stacked"], "--sara-option: stage_inputs='stacked'; allowed: paper, chained"),
    (["--sara-option", "tpp_steps=3"], "--sara-option: .*unexpected keyword argument 'tpp_steps'"),
])
def test_bad_arguments_stop_it_before_anything_loads(arguments, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        sara_shuffle.main(["--out", str(tmp_path), *arguments])
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not list(tmp_path.iterdir())
