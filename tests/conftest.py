"""Fixtures shared by every test folder."""

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from analysis import provenance
from sims import loopback


@pytest.fixture(autouse=True, scope="session")
def tree_counts_as_clean():
    """The tests run in a working tree under edit, where every sweep and benchmark they start would be
    refused as dirty: this repository's tree counts as clean for the session (module fixtures that
    run a sweep included); any other repository is judged as it is, which
    tests/analysis/test_provenance.py checks on repositories of its own."""
    real = provenance.changed_paths

    def changed_paths(repository=provenance.REPOSITORY):
        return [] if Path(repository).resolve() == provenance.REPOSITORY.resolve() else real(repository)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(provenance, "changed_paths", changed_paths)
        yield


# One torch thread in the tests and in every process they start (flwr runs, sweeps, SuperNodes,
# warm workers): tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine
# the threads' synchronisation made the suite ~15x slower (80 s instead of 5 s). Set before any
# test module imports the model code, so module fixtures train single-threaded too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items):
    """Files marked long_file first, then the rest by their number of tests, as pytest-xdist's own
    reordering would (the Makefile turns that off so this order stands): a file of minutes that a
    worker starts last is the suite's tail, where started first its waits overlap the other files'
    work. Stable, so each file's tests stay together and in their order."""
    counts = Counter(item.path for item in items)

    def rank(item) -> tuple[bool, int]:
        return item.get_closest_marker("long_file") is None, -counts[item.path]

    items.sort(key=rank)


def _tensors_of(state, prefix=""):
    """A nested state (dicts, lists, tensors, numbers) flattened to path -> value."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensors_of(value, f"{prefix}{key}/").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _tensors_of(value, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): state}


def _run_outcome(path):
    """What a finished run folder says it produced, free of what legitimately differs between
    two runs of one config: timings, and Flower's node ids (per-client bytes keyed by partition)."""
    import json
    from pathlib import Path

    from training.protocol import NODE_PARTITIONS_FILE
    from training.store import PrivateStore

    path = Path(path)
    partitions = json.loads((path / NODE_PARTITIONS_FILE).read_text())
    metrics = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        record = {key: value for key, value in json.loads(line).items() if not key.endswith("_s")}
        record["bytes_per_client"] = {partitions[node]: sent for node, sent in record["bytes_per_client"].items()}
        metrics.append(record)
    committed = json.loads((path / "committed.json").read_text())["round"]
    server = torch.load(path / "checkpoints" / f"round-{committed:06d}.pt", weights_only=True)
    clients = {store.name: PrivateStore(store).load() for store in sorted((path / "clients").glob("partition-*"))}
    return {"metrics": metrics, "state": _tensors_of({"server": server, "clients": clients})}


@pytest.fixture
def assert_same_outcome():
    """Compare two run folders: identical metrics (but timings) and bit-identical weights and optimiser states."""

    def check(first, second):
        a, b = _run_outcome(first), _run_outcome(second)
        assert a["metrics"] == b["metrics"]
        assert a["state"].keys() == b["state"].keys()
        for key, value in a["state"].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(b["state"][key], value, rtol=0, atol=0, msg=key)
            else:
                assert b["state"][key] == value, key

    return check


def tiny_run_config(tmp_path, **overrides) -> dict:
    """A run config for the tiny profile on a few easy-VQA rows; overrides use dotted keys."""
    config = {
        "paradigm": "usl",
        "model.profile": "tiny",
        "data.dataset": "easyvqa",
        "data.train_limit": 24,
        "data.test_limit": 6,
        "clients.count": 2,
        "train.rounds": 1,
        "train.steps_per_round": 1,
        "train.batch_size": 4,
        "train.lr": 1e-2,
        "eval.every": 0,
        "eval.batch_size": 4,
        "eval.max_new_tokens": 2,
        "faults.timeout_s": 30.0,
        "output.root": str(tmp_path),
        "output.name": "run",
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def tiny_answerer():
    """A random tiny model that reads easy-VQA: (model, word tokenizer, visual features, 60 training rows)."""
    from vlm.features import VisionFeatureCache
    from vlm.loading import build_random_model, clip_image_preprocessor
    from vlm.mini.tokenizer import build_sample_tokenizer
    from vlm.profiles import TINY
    from vqa import load_vqa

    samples = list(load_vqa("easyvqa", "train", limit=60))
    tokenizer = build_sample_tokenizer(samples)
    model = build_random_model(
        TINY, seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
    ).eval()
    features = VisionFeatureCache(model, clip_image_preprocessor(TINY.image_size))
    features.add(samples, progress=False)
    return model, tokenizer, features, samples


@pytest.fixture
def run_config(tmp_path):
    return lambda **overrides: tiny_run_config(tmp_path, **overrides)


@pytest.fixture(scope="session")
def stop_processes_naming():
    """sims.loopback.stop_processes_naming, for tests that start servers outside the test process."""
    return loopback.stop_processes_naming
