"""Shared fixtures: an in-process Grid (the tiny run config is tests/conftest.py's `run_config`).

Strategy and client logic are tested through real Messages on sims.inprocess's grid,
without the ~10 s start-up of `flwr run`; FakeGrid adds hooks to inject faults.
"""

from collections.abc import Callable

import pytest
from flwr.app import Message
from flwr.clientapp import ClientApp

from sims.inprocess import InProcessGrid
from training import protocol



class FakeGrid(InProcessGrid):
    """An in-process grid whose replies a test can intercept, replace, drop or make raise.

    The partition query at a run's start is answered straight: the faults tests inject are a
    client's training and evaluation failing, not the node that never joined.
    """

    def __init__(self, client_app: ClientApp, run_config: dict, num_nodes: int, node_ids: list[int] | None = None) -> None:
        super().__init__(client_app, run_config, num_nodes, node_ids)
        # node -> function(message, reply) returning the reply to deliver (None: no reply), or raising.
        self.interceptors: dict[int, Callable[[Message, Message], Message | None]] = {}

    def deliver(self, message: Message) -> Message | None:
        reply = super().deliver(message)
        node = message.metadata.dst_node_id
        if node not in self.interceptors or message.metadata.message_type == protocol.PARTITION_QUERY:
            return reply
        return self.interceptors[node](message, reply)


@pytest.fixture
def fake_grid():
    return FakeGrid
