"""The deployment recipe of sims/deploy.py on loopback: a real SuperLink (TLS, SuperNode
authentication), the nginx gateway and two SuperNodes. A run finishes with registered nodes
joining through the gateway; nodes without a registered key, without a key, trusting another CA
or speaking plain HTTP are refused; a stranger at the gateway can neither register a key nor
start a run; FL goes on without a node killed mid-round, which then rejoins as itself. Each
message starts a `flwr-clientapp` process, so the runs are the smallest ones (one step)."""

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from sims.deploy import CONNECTION, Deployment, certificate_authority, init, node_key
from sims.launch import installed_tools_environment

pytestmark = [pytest.mark.deployment,
              pytest.mark.skipif(shutil.which("nginx") is None,
                                 reason="nginx is not installed (scripts/setup.sh installs it where apt-get is available)")]
SIMS = Path(__file__).parents[2] / "sims"
STRANGER = "gateway"  # the connection of someone who reaches only the gateway


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited {process.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port} after {timeout}s: {log.read_text()[-2000:]}")


class Federation:
    """The processes of one deployment, started with the operator's environment."""

    def __init__(self, deployment: Deployment, home: Path) -> None:
        self.deployment, self.home = deployment, home
        self.env = {**installed_tools_environment(), "FLWR_HOME": str(home)}
        self.processes: list[subprocess.Popen] = []
        # Each registered SuperNode's command line, by partition (a test may restart one).
        self.node_commands: list[list[str]] = []

    def start(self, name: str, command: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.deployment.folder / f"{name}.log"
        process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=self.env,
                                   start_new_session=True)
        self.processes.append(process)
        return process, log

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["flwr", *args], capture_output=True, text=True, env=self.env, timeout=timeout)

    def node(self, name: str, command: list[str], retries: int | None = None) -> tuple[subprocess.Popen, Path]:
        return self.start(name, [*command, *(["--max-retries", str(retries)] if retries is not None else [])])


@pytest.fixture(scope="module")
def federation(tmp_path_factory, stop_processes_naming):
    folder = tmp_path_factory.mktemp("deploy")
    deployment = init(folder, nodes=2, public=f"127.0.0.1:{free_port()}", superlink_port=free_port())
    home = folder / "flwr-home"
    home.mkdir()
    _, gateway_port = deployment.public.rsplit(":", 1)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n' + deployment.connection()
        + deployment.connection(STRANGER, address=deployment.public))
    fed = Federation(deployment, home)
    try:
        link, link_log = fed.start("superlink", deployment.superlink_command())
        wait_for_port(deployment.superlink_port, link, link_log)
        gateway, gateway_log = fed.start("gateway", deployment.gateway_command())
        wait_for_port(int(gateway_port), gateway, gateway_log)
        for partition in range(deployment.nodes):
            registered = fed.flwr("supernode", "register", str(deployment.node_key(partition)[1]), CONNECTION)
            assert registered.returncode == 0, registered.stdout + registered.stderr
            fed.node_commands.append(deployment.supernode_command(partition, free_port(), folder / f"state{partition}"))
            fed.node(f"node{partition}", fed.node_commands[partition])
        deadline = time.monotonic() + 120
        while len(online_nodes(fed)) < deployment.nodes and time.monotonic() < deadline:
            time.sleep(1)
        assert len(online_nodes(fed)) == deployment.nodes
        yield fed
    finally:
        # A SuperExec detaches from its SuperLink or SuperNode: found by their Runtime API address.
        stop_processes_naming(str(folder), deployment.superlink,
                              *(f"127.0.0.1:{c[c.index('--port') + 1]}" for c in fed.node_commands))
        for process in fed.processes:
            process.wait(timeout=30)


def nodes(fed: Federation) -> list[dict]:
    """Every SuperNode the SuperLink knows, as the operator lists them."""
    listed = fed.flwr("supernode", "list", CONNECTION, "--format", "json")
    return json.loads(listed.stdout)["nodes"]


def online_nodes(fed: Federation) -> list[dict]:
    return [node for node in nodes(fed) if node["status"] == "online"]


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
    assert len(online_nodes(federation)) <= federation.deployment.nodes


def test_a_stranger_at_the_gateway_can_neither_register_a_key_nor_start_a_run(federation, tmp_path):
    known = nodes(federation)
    _, public = node_key(tmp_path, "intruder")
    register = federation.flwr("supernode", "register", str(public), STRANGER)
    assert register.returncode != 0 and "403" in register.stdout + register.stderr
    run = federation.flwr("run", str(SIMS / "cl_easyvqa"), STRANGER, "--stream", timeout=120)
    assert run.returncode != 0 and "403" in run.stdout + run.stderr
    assert [node["node-id"] for node in nodes(federation)] == [node["node-id"] for node in known]


def test_fl_goes_on_without_a_node_killed_mid_round_and_the_node_rejoins_as_itself(
        federation, tmp_path, stop_processes_naming):
    config = (f'model.profile="tiny" data.train_limit=16 data.test_limit=4 clients.count=2 train.rounds=1 '
              f'train.steps_per_round=1 train.batch_size=4 eval.every=0 faults.timeout_s=30.0 '
              f'output.root="{tmp_path}" output.name="killed"')
    run = subprocess.Popen(["flwr", "run", str(SIMS / "fl_easyvqa"), CONNECTION, "--stream", "--run-config", config],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=federation.env)
    node = federation.node_commands[1]
    port = node[node.index("--port") + 1]
    # Node 1 dies while a ClientApp of its trains (one it started after the run's partition
    # queries, whose answers nodes.json records).
    nodes_file, before, deadline = tmp_path / "killed" / "nodes.json", None, time.monotonic() + 240
    while time.monotonic() < deadline:
        if nodes_file.exists():
            before = clientapps(port) if before is None else before
            if clientapps(port) - before:
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"node 1 started no ClientApp for round 1 within 240 s: {run.poll()}")
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
    while any(n["node-id"] == node_id for n in online_nodes(federation)) and time.monotonic() < deadline:
        time.sleep(2)
    federation.node("node1-again", node)
    while node_id not in [n["node-id"] for n in online_nodes(federation)] and time.monotonic() < deadline + 120:
        time.sleep(2)
    assert node_id in [n["node-id"] for n in online_nodes(federation)]


def clientapps(port: str) -> set[int]:
    """The ids of the ClientApp processes serving the SuperNode whose Runtime API is on `port`."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if "flwr-clientapp" in args and f"127.0.0.1:{port}" in args:
            found.add(int(cmdline.parent.name))
    return found
