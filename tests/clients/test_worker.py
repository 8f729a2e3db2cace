"""The warm per-node worker (clients.worker): a relayed message is answered as the handlers
answer it in place, one worker process serves a node's messages, a handler's error comes back
as the ClientApp's error, a worker that never answers is waited for faults.timeout_s, and the
worker leaves when idle or when its SuperNode is gone."""

import os
import signal
import subprocess
import time
import uuid

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.app import app as client_app
from clients.worker import IDLE, WARM_WORKER, WorkerAddress, WorkerFailure, pack_message, relay, unpack_message
from sims.loopback import command_lines
from training import protocol

NODE = 7


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """What flwr-clientapp sets in the relay's process before it runs the app."""
    for name, value in (("_task_id", 3), ("_run_id", 1), ("_node_id", NODE)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.fixture
def address(stop_processes_naming):
    """A fresh worker address (this test process stands in for the SuperNode); its worker is stopped after."""
    made = []

    def make(supernode_pid: int = os.getpid()) -> WorkerAddress:
        made.append(WorkerAddress(f"test-{uuid.uuid4().hex[:12]}", supernode_pid))
        return made[-1]

    yield make
    stop_processes_naming(*(str(found.socket) for found in made))


def message(message_type: str, round_: int = 1) -> Message:
    config = ConfigRecord({"round": round_, "committed-round": round_ - 1})
    sent = Message(content=RecordDict({protocol.CONFIG: config}), message_type=message_type, dst_node_id=NODE)
    sent.metadata.__dict__["_message_id"] = sent.object_id
    return sent


def context(run_config, name: str, idle_s: float = 120.0, timeout_s: float = 30.0) -> Context:
    run_config = run_config(**{"paradigm": "cl", "clients.count": 1, "output.name": name,
                               WARM_WORKER: True, IDLE: idle_s, "faults.timeout_s": timeout_s})
    return Context(run_id=1, node_id=NODE, node_config={protocol.PARTITION_ID: 0}, state=RecordDict(), run_config=run_config)


def worker_pids(address: WorkerAddress) -> set[int]:
    return {pid for pid, args in command_lines().items() if str(address.socket) in args}


def test_a_message_survives_the_socket_format_whole():
    sent = message(protocol.CL_TRAIN, 2)
    sent.content["arrays"] = ArrayRecord([np.arange(12, dtype=np.float32).reshape(3, 4)])
    back = unpack_message(*pack_message(sent))
    assert back.metadata == sent.metadata and back.object_id == sent.object_id
    np.testing.assert_array_equal(back.content["arrays"]["0"].numpy(), sent.content["arrays"]["0"].numpy())


def test_a_relayed_message_is_answered_as_in_place_by_one_warm_worker(run_config, address):
    in_place = client_app(message(protocol.CL_TRAIN), context(run_config, "in-place"))
    at = address()
    relayed_context = context(run_config, "relayed")
    sent = message(protocol.CL_TRAIN)
    relayed = relay(sent, relayed_context, at)
    assert relayed.metadata.reply_to_message_id == sent.metadata.message_id
    expected, got = in_place.content[protocol.METRICS], relayed.content[protocol.METRICS]
    assert got.keys() == expected.keys()
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    (worker,) = worker_pids(at)
    # The next round is served by the same process, from the state it keeps.
    second = relay(message(protocol.CL_TRAIN, 2), relayed_context, at)
    assert second.content[protocol.METRICS]["loss"] != got["loss"] and worker_pids(at) == {worker}
    # A handler's error is the ClientApp's error, and the worker serves on.
    with pytest.raises(WorkerFailure, match="ValueError: train.split_begin is a split-learning message"):
        relay(message(protocol.SPLIT_BEGIN), relayed_context, at)
    assert relay(message(protocol.PARTITION_QUERY), relayed_context, at).content[protocol.METRICS][protocol.PARTITION_ID] == 0
    assert worker_pids(at) == {worker}


def test_the_worker_leaves_when_idle_or_when_its_supernode_is_gone(run_config, address):
    # Slow by nature (about 35 s on 2 cores): three workers start, each importing torch and building its client.
    supernode = subprocess.Popen(["sleep", "600"])
    gone, idle = address(supernode.pid), address()
    relay(message(protocol.PARTITION_QUERY), context(run_config, "gone"), gone)
    relay(message(protocol.PARTITION_QUERY), context(run_config, "idle", idle_s=1.0), idle)
    (worker,) = worker_pids(gone)
    # A worker that never answers is waited for no longer than the server waits.
    os.kill(worker, signal.SIGSTOP)
    with pytest.raises(WorkerFailure, match="no reply from the warm worker within faults.timeout_s=2.0s"):
        relay(message(protocol.PARTITION_QUERY), context(run_config, "gone", timeout_s=2.0), gone)
    os.kill(worker, signal.SIGCONT)
    supernode.kill()
    supernode.wait()
    deadline = time.monotonic() + 30
    while (worker_pids(gone) or worker_pids(idle)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not worker_pids(gone) and not gone.socket.exists()
    assert not worker_pids(idle) and not idle.socket.exists()
    # The next message at the idle address starts a new worker.
    assert relay(message(protocol.PARTITION_QUERY), context(run_config, "idle", idle_s=1.0), idle).content[protocol.METRICS]
