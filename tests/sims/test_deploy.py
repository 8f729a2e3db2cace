"""The deployment recipe of sims/deploy.py on loopback: a real SuperLink (TLS, SuperNode
authentication), the nginx gateway and two SuperNodes. A run finishes with registered nodes
joining through the gateway; nodes without a registered key, without a key, trusting another CA
or speaking plain HTTP are refused; a stranger at the gateway can neither register a key nor
start a run; FL goes on without a node killed mid-round, which then rejoins as itself; USL
skips the turn of a node whose message never gets an answer; a run resumes after the SuperLink
restarts from its database. The processes are sims.loopback's; the runs are the smallest ones
(one step).

Slow by nature (over 30 s a test where a run starts): each `flwr run` here starts a ServerApp and,
on each node, a warm worker that imports torch and the model code before its first answer (about
15 s on 2 cores, over 30 s under load), and two tests wait out a fault: a hung message for
faults.timeout_s, a dead node for Flower's heartbeat patience (2 x 30 s)."""

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from sims.deploy import CONNECTION, certificate_authority, node_key
from sims.launch import toml_value
from sims.loopback import STRANGER, LoopbackFederation, command_lines, free_port, wait_for_port

pytestmark = [pytest.mark.deployment,
              pytest.mark.skipif(shutil.which("nginx") is None,
                                 reason="nginx is not installed (scripts/setup.sh installs it where apt-get is available)")]
SIMS = Path(__file__).parents[2] / "sims"


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    with LoopbackFederation(tmp_path_factory.mktemp("deploy"), nodes=2) as fed:
        yield fed


def small_run(tmp_path: Path, name: str, **changes) -> str:
    """--run-config of the smallest run of two clients (one round of one step), with `changes`."""
    values = {"model.profile": "tiny", "data.train_limit": 16, "data.test_limit": 4, "clients.count": 2,
              "train.rounds": 1, "train.steps_per_round": 1, "train.batch_size": 4, "eval.every": 0,
              "faults.timeout_s": 30.0, "output.root": str(tmp_path), "output.name": name, **changes}
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def federation_run(federation: LoopbackFederation, sim: str, config: str) -> subprocess.Popen:
    """`flwr run` of sims/`sim` on the deployment, its output streamed into a pipe."""
    return subprocess.Popen(["flwr", "run", str(SIMS / sim), CONNECTION, "--stream", "--run-config", config],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=federation.env)


def runtime_port(federation: LoopbackFederation, partition: int) -> str:
    """The Runtime API port of SuperNode `partition`, which its processes name."""
    node = federation.node_commands[partition]
    return node[node.index("--port") + 1]


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


def test_usl_skips_the_turn_of_a_node_whose_message_never_gets_an_answer(federation, tmp_path):
    # Slow by nature: the hung message is given up only after faults.timeout_s, which must also outlast
    # the partition queries' cold start of each node's warm worker (over 30 s on a loaded machine).
    run = federation_run(federation, "usl_easyvqa", small_run(tmp_path, "hung", **{"faults.timeout_s": 60.0}))
    port = runtime_port(federation, 1)
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


def test_fl_goes_on_without_a_node_killed_mid_round_and_the_node_rejoins_as_itself(
        federation, tmp_path, stop_processes_naming):
    # The round learns of the dead node from the SuperLink, which answers for a node whose heartbeat
    # has stopped (36-60 s after it died), so faults.timeout_s only bounds; it also bounds the
    # partition queries, which cold-start each node's warm worker: over 30 s on a loaded machine.
    run = federation_run(federation, "fl_easyvqa", small_run(tmp_path, "killed", **{"faults.timeout_s": 300.0}))
    node = federation.node_commands[1]
    port = runtime_port(federation, 1)
    # Node 1 dies while a ClientApp of its trains: one it started after nodes.json was written,
    # which the run does once the partition queries' ClientApps have answered. Judged by start
    # times, not by which ClientApps a poll saw first: under load one poll can miss the moment.
    nodes_file, deadline = tmp_path / "killed" / "nodes.json", time.monotonic() + 300
    while not (nodes_file.exists() and clientapps(port, started_after=nodes_file.stat().st_mtime)):
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            status = tmp_path / "killed" / "status.json"
            pytest.fail(f"node 1 started no ClientApp for round 1; status: "
                        f"{status.read_text() if status.exists() else None}\n{run.communicate()[0][-3000:]}")
        time.sleep(0.1)
    node_id = next(n for n, partition in json.loads(nodes_file.read_text()).items() if partition == 1)
    stop_processes_naming(f"--port {port} ", f"127.0.0.1:{port}")
    output, _ = run.communicate(timeout=600)
    status = json.loads((tmp_path / "killed" / "status.json").read_text())
    (record,) = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert status["state"] == "finished", output[-3000:]
    assert record["clients_averaged"] == 1 and [f["client"] for f in record["faults"]] == [int(node_id)]
    assert status["complete"] is False and status["failed_partitions"] == {"1": [1]}
    # Once the SuperLink has seen it go (its heartbeat stopped), it rejoins with its key and state-dir.
    deadline = time.monotonic() + 180
    while any(n["node-id"] == node_id for n in federation.online_nodes()) and time.monotonic() < deadline:
        time.sleep(2)
    federation.node("node1-again", node)
    while node_id not in [n["node-id"] for n in federation.online_nodes()] and time.monotonic() < deadline + 120:
        time.sleep(2)
    assert node_id in [n["node-id"] for n in federation.online_nodes()]


def clientapps(port: str, started_after: float) -> set[int]:
    """The ids of the ClientApp processes serving the SuperNode whose Runtime API is on `port`
    that started after `started_after` (seconds since the epoch)."""
    return {pid for pid, args in command_lines().items()
            if "flwr-clientapp" in " ".join(args) and f"127.0.0.1:{port}" in " ".join(args)
            and start_time(pid) > started_after}


def start_time(pid: int) -> float:
    """When process `pid` started, in seconds since the epoch (-inf if it has ended). /proc counts
    it in clock ticks since boot (field 22 of stat); the boot's epoch time from this moment's two
    clocks, which, unlike /proc/stat's btime, is not rounded to the second."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError):
        return -math.inf
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def node_workers(port: str) -> set[int]:
    """The warm workers (clients.worker) serving the SuperNode whose Runtime API is on `port`:
    those started for one of its processes (the last but one argument)."""
    commands = command_lines()
    node = {pid for pid, args in commands.items()
            if f"--port {port} " in " ".join(args) + " " or f"127.0.0.1:{port}" in " ".join(args)}
    return {pid for pid, args in commands.items()
            if "clients.worker" in args and len(args) > 1 and args[-2].isdigit() and int(args[-2]) in node}


def test_a_run_resumes_after_the_superlink_restarts_from_its_database(federation, tmp_path, stop_processes_naming):
    deployment = federation.deployment
    # The resumed run's first messages cold-start new warm workers while the first run's may still finish the
    # round it was killed in: on a loaded machine that outlasts a minute, so no message is judged hung
    # before a worker could have started (clients.worker.START_TIMEOUT_S).
    config = small_run(tmp_path, "restarted", **{"train.rounds": 2, "faults.timeout_s": 300.0})
    first = federation_run(federation, "fl_easyvqa", config)
    metrics, deadline = tmp_path / "restarted" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and first.poll() is None, "round 1 did not finish"
        time.sleep(0.2)
    # The SuperLink dies with the ServerApp it runs, then comes back from the same database.
    stop_processes_naming(f"--port {deployment.superlink_port}", deployment.superlink)
    first.communicate(timeout=60)
    assert json.loads((tmp_path / "restarted" / "status.json").read_text())["state"] != "finished"
    link, log = federation.start("superlink-again", deployment.superlink_command())
    wait_for_port(deployment.superlink_port, link, log)
    deadline = time.monotonic() + 180
    while len(federation.online_nodes()) < deployment.nodes:
        assert time.monotonic() < deadline, "the SuperNodes did not come back to the restarted SuperLink"
        time.sleep(2)
    again = federation_run(federation, "fl_easyvqa", config)
    again.communicate(timeout=600)
    status = json.loads((tmp_path / "restarted" / "status.json").read_text())
    assert status["state"] == "finished" and status["complete"], status
    assert [json.loads(line)["round"] for line in metrics.read_text().splitlines()] == [1, 2]
