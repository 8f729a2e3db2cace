"""Shared fixtures: an in-process Grid.

Strategy and client logic are tested through real Messages on sims.inprocess's grid,
without the ~10 s start-up of `flwr run`; FakeGrid adds hooks to inject faults.
"""

from collections.abc import Callable

import pytest
from flwr.app import Message
from flwr.clientapp import ClientApp

from sims.inprocess import InProcessGrid



class FakeGrid(InProcessGrid):
    """An in-process grid whose replies a test can intercept, replace, drop or make raise."""

    def __init__(self, client_app: ClientApp, run_config: dict, num_nodes: int) -> None:
        super().__init__(client_app, run_config, num_nodes)
        # node -> function(message, reply) returning the reply to deliver (None: no reply), or raising.
        self.interceptors: dict[int, Callable[[Message, Message], Message | None]] = {}

    def deliver(self, message: Message) -> Message | None:
        reply = super().deliver(message)
        node = message.metadata.dst_node_id
        return self.interceptors[node](message, reply) if node in self.interceptors else reply


@pytest.fixture
def fake_grid():
    return FakeGrid


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


@pytest.fixture
def run_config(tmp_path):
    return lambda **overrides: tiny_run_config(tmp_path, **overrides)
