"""One command replays an attack against a run the Recorder recorded, scored against the run's own data."""

import json

import pytest

from attacks import MissingObservationError, Recorder, Recording
from attacks.cli import main
from attacks.replay import replay
from clients.app import app as client_app
from sims.inprocess import InProcessGrid
from sims.schema import load_config
from strategies import app as server_app
from strategies.app import run


def tiny_run(tmp_path, monkeypatch, **overrides):
    raw = {
        "paradigm": "usl", "model.profile": "tiny", "data.dataset": "easyvqa", "data.train_limit": 24,
        "data.test_limit": 6, "clients.count": 2, "train.rounds": 2, "train.steps_per_round": 2,
        "train.batch_size": 4, "train.lr": 1e-2, "eval.every": 0, "faults.timeout_s": 30.0,
        "output.root": str(tmp_path), "output.name": "run", **overrides,
    }
    monkeypatch.setattr(server_app, "OBSERVER_FACTORIES", [Recorder.factory()])
    return run(InProcessGrid(client_app, raw, 2), load_config(raw)).path


def test_actinv_replayed_on_a_recorded_usl_run_recovers_the_clients_questions(tmp_path, monkeypatch):
    folder = tiny_run(tmp_path, monkeypatch)
    recording = Recording.open(folder)
    # 2 rounds × 2 clients × 2 steps: each step's activation at CA and gradient at CB.
    assert len(recording.select("activation at CA")) == 8 and len(recording.select("gradient at CB")) == 8
    # Scored against the batches the run's seeded order gave each client and step: a wrong
    # step or partition would pair the recovered text with another question.
    result = replay(folder, "actinv", options={"iterations": 200, "max_transfers": 4, "progress": False},
                    aux_limit=16)
    print(result.metrics)
    assert result.metrics["exact_match"] == 1.0
    saved = json.loads((folder / "attacks" / "actinv.json").read_text())
    assert saved["metrics"] == pytest.approx(result.metrics)


def test_a_recording_without_what_the_attack_needs_is_refused_by_name(tmp_path, monkeypatch):
    folder = tiny_run(tmp_path, monkeypatch, **{"train.rounds": 1, "train.steps_per_round": 1})
    # The USL server's own rows at CB are not what it received: only a strategy that reports them records them.
    with pytest.raises(MissingObservationError, match="'activation at CB'.*direction 'down'"):
        main(["run", str(folder), "idlg", "--aux-limit", "8", "-o", "progress=false"])
