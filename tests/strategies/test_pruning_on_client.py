"""QPriv-VL runs on the client in every paradigm, and its keep indices never leave it."""

import json

import numpy as np
import pytest
import torch

from clients import runtime as client_runtime_module
from clients.app import app as client_app
from pruning import keep_count
from pruning.metrics import RECORD_PREFIX
from config import load_config
from strategies.app import run
from training import protocol
from training.selector import build_selector
from wire.wire import RAW_STYPE

TINY_PATCHES, TINY_K_MIN = 16, 1
INTEGER_PAYLOADS = {"lengths", "answers", "answer_lengths"}
OUTCOME_LISTS = {protocol.QUESTIONS, protocol.QUESTION_SCORES, protocol.ZERO_SHOT_SCORES}


def as_numpy(array) -> np.ndarray:
    """A Flower Array as sent: the wire's raw bytes ("torch.raw") or a numpy payload."""
    if array.stype != RAW_STYPE:
        return array.numpy()
    dtype, shape = getattr(torch, array.dtype), tuple(array.shape)
    if array.data:
        tensor = torch.frombuffer(bytearray(array.data), dtype=torch.uint8).view(dtype).reshape(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    return (tensor.float() if tensor.is_floating_point() else tensor).numpy()  # numpy has no bfloat16


@pytest.mark.parametrize("paradigm", ["cl", "fl", "sl", "usl"])
def test_keep_indices_never_leave_the_client(paradigm, run_config, fake_grid, monkeypatch):
    count = 1 if paradigm == "cl" else 2
    raw = run_config(
        paradigm=paradigm,
        **{"clients.count": count, "train.steps_per_round": 2, "eval.every": 1, "pruning.policy": "fixed", "pruning.ratio": 0.5},
    )
    chosen = []

    def recording_build_selector(config, **context):
        selector = build_selector(config, **context)

        def select(features, samples):
            selection = selector(features, samples)
            chosen.extend(indices.numpy() for indices in selection.keep)
            return selection

        return select

    monkeypatch.setattr(client_runtime_module, "build_selector", recording_build_selector)
    grid = fake_grid(client_app, raw, count)
    replies = []
    for node in range(1, count + 1):
        grid.interceptors[node] = lambda message, reply: replies.append(reply) or reply
    folder = run(grid, load_config(raw))

    kept = keep_count(0.5, TINY_PATCHES, TINY_K_MIN)
    assert chosen and {len(indices) for indices in chosen} == {kept}
    # Different samples keep different patches: the indices are information worth hiding.
    assert len({indices.tobytes() for indices in chosen}) > 1
    record = json.loads((folder.path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["kept_tokens_mean"] == record["kept_tokens_min"] == record["kept_tokens_max"] == kept
    for reply in replies:
        content = reply.content
        for array_record in content.array_records.values():
            for name, array in array_record.items():
                values = as_numpy(array)
                # Integers cross only as per-sample sequence lengths and SL's answer labels (the
                # SL server computes the loss), never as positions of visual tokens.
                assert values.dtype.kind == "f" or name in INTEGER_PAYLOADS, name
                assert not any(np.array_equal(values.ravel(), indices) for indices in chosen), name
        for metric_record in content.metric_records.values():
            for name, value in metric_record.items():
                # Lists only for the pruning record's per-sample counts and ratios (the
                # server sees each sample's length anyway) and the evaluation's per-question
                # positions and scores, never the keep indices.
                assert isinstance(value, int | float) or name.startswith(RECORD_PREFIX) or name in OUTCOME_LISTS, name
                assert not any(np.array_equal(np.asarray(value).ravel(), indices) for indices in chosen), name
        for config_record in content.config_records.values():
            assert all(not isinstance(value, list) for value in config_record.values())


@pytest.mark.parametrize(("policy", "options"), [("fastv", {"pruning.attention_layer": 0}),
                                                ("sparsevlm", {"pruning.attention_layer": 0}), ("visionzip", {})])
def test_a_policy_that_ranks_with_the_clients_own_model_prunes_on_the_client(policy, options, run_config, fake_grid):
    raw = run_config(paradigm="usl", **{"clients.count": 2, "train.steps_per_round": 2, "eval.every": 1,
                                        "pruning.policy": policy, "pruning.ratio": 0.5, **options})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    record = json.loads((folder.path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["kept_tokens_mean"] == record["kept_tokens_max"] == keep_count(0.5, TINY_PATCHES, TINY_K_MIN)
