"""A party's private store: per-round snapshots, per-part writes, discarding a killed run's leftovers."""

import torch

from training.store import PrivateStore


def test_a_round_starts_from_the_previous_snapshot_and_rewrites_only_its_parts(tmp_path):
    store = PrivateStore(tmp_path)
    assert store.load() is None and store.version() is None
    store.save(1, {"head": torch.tensor([1.0]), "tail": torch.tensor([2.0])})
    store.save(2, {"tail": torch.tensor([3.0])})
    assert {k: float(v) for k, v in store.load().items()} == {"head": 1.0, "tail": 3.0}
    # Round 1's snapshot is untouched by round 2's write.
    assert float(torch.load(tmp_path / "round-000001" / "tail.pt")) == 2.0


def test_begin_round_goes_back_to_the_committed_snapshot(tmp_path):
    store = PrivateStore(tmp_path)
    store.save(1, {"head": torch.tensor([1.0])})
    store.save(2, {"head": torch.tensor([2.0])})  # a killed round 2: the server committed only round 1
    store.begin_round(1)
    assert float(store.load()["head"]) == 1.0 and store.version()[0] == 1
    store.begin_round(1)
    store.save(2, {"head": torch.tensor([5.0])})
    store.begin_round(2)  # round 2 committed: round 1 is no longer needed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000002"]


def test_the_version_changes_with_every_write(tmp_path):
    store = PrivateStore(tmp_path)
    store.save(1, {"head": torch.tensor([1.0])})
    first = store.version()
    store.save(1, {"head": torch.tensor([2.0])})
    assert store.version() != first
