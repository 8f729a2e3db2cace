"""What keeps runs honest and apart: status.json's liveness (a live run's heartbeat is renewed
while its server works, an ended run's is not, a live status whose heartbeat stopped reads as a
dead server), and each run's own client state under a node's state-dir."""

import json
import threading

import pytest

from clients.runtime import client_state_dir
from config import load_config
from strategies.callbacks import STALE_AFTER_S, Heartbeat, RunFolder, is_stale


def test_a_live_run_beats_and_an_ended_one_keeps_its_end(run_config, tmp_path, monkeypatch):
    folder = RunFolder(load_config(run_config()), tmp_path / "run")
    folder.write_status("running", round=1)
    first = json.loads((folder.path / "status.json").read_text())
    beaten_times, beat = threading.Condition(), folder.beat
    count = [0]

    def counted_beat():
        beat()
        with beaten_times:
            count[0] += 1
            beaten_times.notify_all()

    def beats(at_least: int) -> bool:
        with beaten_times:
            return beaten_times.wait_for(lambda: count[0] >= at_least, timeout=30)

    monkeypatch.setattr(folder, "beat", counted_beat)
    with Heartbeat(folder, every=0.02):
        assert beats(1)
        beaten = json.loads((folder.path / "status.json").read_text())
        assert beaten["heartbeat"] > first["heartbeat"] and beaten["round"] == 1 and beaten["time"] == first["time"]
        folder.write_status("finished", rounds=1)
        ended = json.loads((folder.path / "status.json").read_text())
        assert beats(count[0] + 2)  # at least one whole beat after the end
    assert json.loads((folder.path / "status.json").read_text()) == ended


def test_a_live_status_without_a_recent_heartbeat_is_a_dead_server():
    now = 1_000_000.0
    assert not is_stale({"state": "running", "heartbeat": now - 5}, now)
    assert is_stale({"state": "running", "heartbeat": now - STALE_AFTER_S - 1}, now)
    assert is_stale({"state": "starting", "time": now - STALE_AFTER_S - 1}, now)
    assert not is_stale({"state": "finished", "heartbeat": now - 10 * STALE_AFTER_S}, now)


def test_a_nodes_state_dir_keeps_each_run_apart_and_a_resumed_run_with_itself(run_config, tmp_path):
    node = tmp_path / "node0"
    first = load_config(run_config(**{"output.name": "a"}))
    other_settings = load_config(run_config(**{"output.name": "a", "train.lr": 0.5}))
    other_name = load_config(run_config(**{"output.name": "b"}))
    resumed = load_config(run_config(**{"output.name": "a", "train.rounds": 9}))
    where = client_state_dir(first, 0, node)
    assert where.parent.parent == node and where.name == "partition-0"
    assert client_state_dir(resumed, 0, node) == where
    assert len({where, client_state_dir(other_settings, 0, node), client_state_dir(other_name, 0, node),
                client_state_dir(first, 1, node)}) == 4
    assert client_state_dir(first, 0, None) == first.run_folder() / "clients" / "partition-0"


def test_a_folder_whose_rounds_were_trained_on_other_weights_is_not_resumed(run_config, tmp_path):
    config = load_config(run_config())
    folder = RunFolder(config, tmp_path / "run")
    folder.write_status("finished", rounds=1)
    (folder.path / "committed.json").write_text(json.dumps({"round": 1}))
    RunFolder(config, folder.path)  # the same weights resume
    status = json.loads((folder.path / "status.json").read_text())
    (folder.path / "status.json").write_text(json.dumps({**status, "weights": "mini-scenes recipe 0ld, weights 0ld"}))
    with pytest.raises(ValueError, match="was trained on mini-scenes recipe 0ld, weights 0ld, but .* now loads"):
        RunFolder(config, folder.path)
    # A status written before the model was built names no weights: nothing to compare.
    (folder.path / "status.json").write_text(json.dumps({**status, "weights": "mini-scenes recipe 0ld, not built"}))
    RunFolder(config, folder.path)
