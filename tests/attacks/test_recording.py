"""The recording holds exactly what the server received, up to its cap, and survives a resumed run."""

import json

import pytest
import torch
from flwr.app import RecordDict

from attacks import MissingObservationError, Recorder, Recording
from attacks.recording import INDEX_FILE
from wire import Wire


def activation(samples=2, length=3, width=4, dtype=torch.float32):
    return {"rows": torch.randn(samples * length, width).to(dtype), "lengths": torch.full((samples,), length)}


def test_a_recorder_on_the_wire_stores_what_the_server_decoded(tmp_path):
    wire = Wire("bf16")
    recorder = Recorder(tmp_path / "rec")
    wire.subscribe(recorder)
    sent = activation()
    content = RecordDict({"wire": Wire("bf16").encode(sent)})
    received = wire.received(3, 7, "activation at CA", content,
                             {"rows": ((None, 4), "float"), "lengths": ((None,), "index")})
    recording = Recording.open(tmp_path / "rec")
    (entry,) = recording.entries
    assert (entry.round, entry.client, entry.kind, entry.direction, entry.occurrence) == (3, 7, "activation at CA",
                                                                                        "up", 0)
    assert entry.samples == 2 and entry.num_bytes == wire.ledger.bytes[3, 7, "up"]
    stored = recording.tensors(entry)
    assert stored["rows"].dtype == torch.bfloat16 and torch.equal(stored["rows"], received["rows"])
    assert torch.equal(stored["lengths"], received["lengths"])


def test_the_cap_stores_a_prefix_and_still_indexes_everything(tmp_path):
    one = activation()
    size = sum(t.numel() * t.element_size() for t in one.values())
    recorder = Recorder(tmp_path / "rec", max_bytes=2 * size + 1)
    for occurrence in range(4):
        recorder.record(1, 1, "activation at CA", activation())
    recorder.record(1, 1, "gradient at CB", {"grad": torch.zeros(1, 1)})  # small, but after the cap was hit
    recording = Recording.open(tmp_path / "rec")
    assert [e.stored for e in recording.entries] == [True, True, False, False, False]
    assert [e.occurrence for e in recording.entries] == [0, 1, 2, 3, 0]
    with pytest.raises(MissingObservationError, match="cap"):
        recording.tensors(recording.entries[2])
    samples_capped = Recorder(tmp_path / "by-samples", max_samples=3)
    assert [samples_capped.record(1, 1, "activation at CA", activation()).stored for _ in range(2)] == [True, False]


def test_listed_rounds_are_stored_each_under_its_own_cap_and_replayed_one_at_a_time(tmp_path):
    recorder = Recorder(tmp_path / "rec", max_samples=4, rounds=[1, 3])
    stored = [[recorder.record(round_, 1, "activation at CA", activation()).stored for _ in range(3)]
              for round_ in (1, 2, 3)]
    # Round 1 fills its cap of 4 samples with two transfers; round 2 is not listed; round 3 has its own cap.
    assert stored == [[True, True, False], [False, False, False], [True, True, False]]
    recording = Recording.open(tmp_path / "rec")
    late = recording.at_round(3)
    assert {e.round for e in late.entries} == {3} and len(late.select("activation at CA")) == 2
    assert len(recording.entries) == 9  # the view leaves the recording whole
    with pytest.raises(MissingObservationError, match=r"no transfer of round 2; rounds stored: \[1, 3\]"):
        recording.at_round(2)
    # A resumed run keeps each round's count against its cap.
    resumed = Recorder(tmp_path / "rec", max_samples=4, rounds=[1, 3], committed_round=3)
    assert not resumed.record(3, 1, "activation at CA", activation()).stored


def test_a_resumed_run_drops_what_was_recorded_after_its_last_committed_round(tmp_path):
    recorder = Recorder(tmp_path / "rec")
    for round_ in (1, 2, 3):
        recorder.record(round_, 1, "activation at CA", activation())
    resumed = Recorder(tmp_path / "rec", committed_round=2)
    entry = resumed.record(3, 1, "activation at CA", activation())
    recording = Recording.open(tmp_path / "rec")
    assert [e.round for e in recording.entries] == [1, 2, 3]
    assert entry.seq == 2 and entry.occurrence == 0
    assert len(list((tmp_path / "rec" / "transfers").iterdir())) == 3


def test_an_index_line_torn_by_a_kill_is_dropped_on_resume_and_damage_before_it_is_named(tmp_path, caplog):
    recorder = Recorder(tmp_path / "rec")
    for round_ in (1, 2):
        recorder.record(round_, 1, "activation at CA", activation())
    index = tmp_path / "rec" / INDEX_FILE
    whole = index.read_text()
    index.write_text(whole + whole.splitlines()[-1][:25])  # round 3's line, cut short mid-append
    assert [e.round for e in Recording.open(tmp_path / "rec").entries] == [1, 2]
    assert f"{index} line 3 is torn" in caplog.text
    resumed = Recorder(tmp_path / "rec", committed_round=2)
    resumed.record(3, 1, "activation at CA", activation())
    assert [e.round for e in Recording.open(tmp_path / "rec").entries] == [1, 2, 3]
    lines = index.read_text().splitlines()
    index.write_text("\n".join([lines[0][:25], *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=f"{index} line 1 is damaged"):
        Recording.open(tmp_path / "rec")


def test_a_missing_observation_is_named_with_what_the_recording_holds(tmp_path):
    recorder = Recorder(tmp_path / "recording", header={"config": {"paradigm": "fl"}})
    recorder.record(1, 1, "adapter update", {"w": torch.zeros(2)})
    recording = Recording.open(tmp_path)  # a run folder holding recording/
    with pytest.raises(MissingObservationError, match=r"'gradient at CB'.*'adapter update' \(up, stored\) ×1"):
        recording.require("gradient at CB", attack="idlg")
    with pytest.raises(MissingObservationError, match="only SL and USL runs send"):
        recording.first_cut_kind(attack="fora")
    with pytest.raises(FileNotFoundError, match="threat.model=\"passive\""):
        Recording.open(tmp_path / "nowhere")


def test_the_index_is_one_json_line_per_transfer(tmp_path):
    recorder = Recorder(tmp_path / "rec")
    recorder.record(1, 2, "activation at CB", {"rows": torch.zeros(3, 4)}, direction="down")
    (line,) = (tmp_path / "rec" / INDEX_FILE).read_text().splitlines()
    assert json.loads(line)["tensors"] == {"rows": {"shape": [3, 4], "dtype": "float32"}}
    with pytest.raises(ValueError, match="direction"):
        recorder.record(1, 2, "x", {}, direction="sideways")


def test_a_kind_the_protocol_does_not_know_is_refused(tmp_path):
    recorder = Recorder(tmp_path / "rec")
    with pytest.raises(ValueError, match=r"'activation at CQ' is not in the protocol.*'activation at CA'"):
        recorder.record(1, 1, "activation at CQ", {"rows": torch.zeros(1, 1)})
    with pytest.raises(ValueError, match="'gradient at CB' travels 'up'"):
        recorder.record(1, 1, "gradient at CB", {"grad": torch.zeros(1, 1)}, direction="down")
    assert not (tmp_path / "rec" / INDEX_FILE).read_text()
