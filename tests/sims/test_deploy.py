"""The deployment recipe of sims/deploy.py on loopback: a real SuperLink (TLS, SuperNode
authentication), the nginx gateway and two SuperNodes. A run finishes with registered nodes
joining through the gateway; nodes without a registered key, without a key, trusting another CA
or speaking plain HTTP are refused; a stranger at the gateway can neither register a key nor
start a run; USL skips the turn of a node whose message never gets an answer. The processes are
sims.loopback's (tests/sims/conftest.py); the runs are the smallest ones (one step).
test_deploy_restarts.py restarts a node and the SuperLink on a federation of its own.

Slow by nature (over 30 s a test where a run starts): each `flwr run` here starts a ServerApp and,
on each node, a warm worker that imports torch and the model code before its first answer (about
15 s on 2 cores, over 30 s under load), and the hung message is waited out for faults.timeout_s."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from sims.deploy import CONNECTION, certificate_authority, node_key
from sims.loopback import STRANGER, command_lines, free_port

pytestmark = [pytest.mark.deployment, pytest.mark.long_file,
              pytest.mark.skipif(shutil.which("nginx") is None,
                                 reason="nginx is not installed (scripts/setup.sh installs it where apt-get is available)")]
SIMS = Path(__file__).parents[2] / "sims"


def test_a_run_finishes_over_tls_with_a_registered_node_joining_through_the_gateway(federation, tmp_path):
    config = (f'model.profile="tiny" data.train_limit=8 data.test_limit=4 clients.count=1 train.rounds=1 '
              f'train.steps_per_round=1 train.batch_size=4 eval.every=0 output.root="{tmp_path}" output.name="tls"')
    run = federation.flwr("run", str(SIMS / "cl_easyvqa"), CONNECTION, "--stream", "--run-config", config, timeout=400)
    status = json.loads((tmp_path / "tls" / "status.json").read_text())
    assert status["state"] == "finished" and status["complete"], run.stdout[-3000:]
    # The node spoke to the SuperLink through the gateway, and only the Fleet API.
    requests = (federation.deployment.folder / "gateway-access.log").read_text().splitlines()
    assert any("/v1/fleet/pull-messages" in line for line in requests)
    assert all(" 403 " in line or "/v1/fleet/" in line for line in requests)


@pytest.mark.parametrize("case", ["unregistered key", "no key", "another CA", "plain HTTP"])
def test_a_node_without_a_registered_key_the_ca_or_tls_is_refused(case, federation, tmp_path):
    deployment = federation.deployment
    command = deployment.supernode_command(0, free_port())
    if case == "unregistered key":
        private, _ = node_key(tmp_path, "stranger")
        command[command.index("--auth-supernode-private-key") + 1] = str(private)
    elif case == "no key":
        at = command.index("--auth-supernode-private-key")
        del command[at:at + 2]
    elif case == "another CA":
        _, other = certificate_authority("another CA")
        (tmp_path / "other-ca.crt").write_bytes(other.public_bytes(Encoding.PEM))
        command[command.index("--root-certificates") + 1] = str(tmp_path / "other-ca.crt")
    else:
        at = command.index("--root-certificates")
        command[at:at + 2] = ["--insecure"]
    process, log = federation.node(case.replace(" ", "-"), command, retries=2)
    assert process.wait(timeout=120) != 0, log.read_text()[-2000:]
    assert len(federation.online_nodes()) <= federation.deployment.nodes


def test_a_stranger_at_the_gateway_can_neither_register_a_key_nor_start_a_run(federation, tmp_path):
    known = federation.nodes()
    _, public = node_key(tmp_path, "intruder")
    register = federation.flwr("supernode", "register", str(public), STRANGER)
    assert register.returncode != 0 and "403" in register.stdout + register.stderr
    run = federation.flwr("run", str(SIMS / "cl_easyvqa"), STRANGER, "--stream", timeout=120)
    assert run.returncode != 0 and "403" in run.stdout + run.stderr
    assert [node["node-id"] for node in federation.nodes()] == [node["node-id"] for node in known]


def test_usl_skips_the_turn_of_a_node_whose_message_never_gets_an_answer(federation, small_run, tmp_path):
    # Slow by nature: the hung message is given up only after faults.timeout_s, which must also outlast
    # the partition queries' cold start of each node's warm worker (over 30 s on a loaded machine).
    run = federation.run(SIMS / "usl_easyvqa", small_run("hung", **{"faults.timeout_s": 60.0}))
    port = federation.runtime_port(1)
    # Node 1's warm worker (started by the partition queries, which nodes.json records) hangs:
    # it stays up and connected, but never answers.
    nodes_file, deadline = tmp_path / "hung" / "nodes.json", time.monotonic() + 240
    while not (nodes_file.exists() and node_workers(port)):
        assert time.monotonic() < deadline and run.poll() is None, "node 1 started no warm worker"
        time.sleep(0.1)
    hung = node_workers(port)
    for pid in hung:
        os.kill(pid, signal.SIGSTOP)
    try:
        output, _ = run.communicate(timeout=600)
    finally:
        for pid in hung:
            os.kill(pid, signal.SIGCONT)
    status = json.loads((tmp_path / "hung" / "status.json").read_text())
    (record,) = [json.loads(line) for line in (tmp_path / "hung" / "metrics.jsonl").read_text().splitlines()]
    node_id = next(int(n) for n, partition in json.loads(nodes_file.read_text()).items() if partition == 1)
    assert status["state"] == "finished", output[-3000:]
    assert status["complete"] is False and status["failed_partitions"] == {"1": [1]}
    assert [f["client"] for f in record["faults"]] == [node_id] and "faults.timeout_s" in record["faults"][0]["reason"]


def node_workers(port: str) -> set[int]:
    """The warm workers (clients.worker) serving the SuperNode whose Runtime API is on `port`:
    those started for one of its processes (the last but one argument)."""
    commands = command_lines()
    node = {pid for pid, args in commands.items()
            if f"--port {port} " in " ".join(args) + " " or f"127.0.0.1:{port}" in " ".join(args)}
    return {pid for pid, args in commands.items()
            if "clients.worker" in args and len(args) > 1 and args[-2].isdigit() and int(args[-2]) in node}
