"""The deployment recipe of sims/deploy.py on loopback: a real SuperLink (TLS, SuperNode
authentication), the nginx gateway and SuperNodes. A run finishes with registered nodes joining
through the gateway; nodes without a registered key, without a key, trusting another CA or
speaking plain HTTP are refused; a stranger at the gateway can neither register a key nor start
a run. Each message starts a `flwr-clientapp` process, so the run is the smallest one (CL, one
step)."""

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
    deployment = init(folder, nodes=1, public=f"127.0.0.1:{free_port()}", superlink_port=free_port())
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
        registered = fed.flwr("supernode", "register", str(deployment.node_key(0)[1]), CONNECTION)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        fed.node("node0", deployment.supernode_command(0, free_port(), folder / "state0"))
        yield fed
    finally:
        stop_processes_naming(str(folder))


def nodes(fed: Federation) -> list[dict]:
    """Every SuperNode the SuperLink knows, as the operator lists them."""
    listed = fed.flwr("supernode", "list", CONNECTION, "--format", "json")
    return json.loads(listed.stdout)["nodes"]


def online_nodes(fed: Federation) -> list[dict]:
    return [node for node in nodes(fed) if node["status"] == "online"]


def test_a_run_finishes_over_tls_with_a_registered_node_joining_through_the_gateway(federation, tmp_path):
    deadline = time.monotonic() + 90
    while not online_nodes(federation) and time.monotonic() < deadline:
        time.sleep(1)
    assert len(online_nodes(federation)) == 1
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
    assert len(online_nodes(federation)) <= 1


def test_a_stranger_at_the_gateway_can_neither_register_a_key_nor_start_a_run(federation, tmp_path):
    known = nodes(federation)
    _, public = node_key(tmp_path, "intruder")
    register = federation.flwr("supernode", "register", str(public), STRANGER)
    assert register.returncode != 0 and "403" in register.stdout + register.stderr
    run = federation.flwr("run", str(SIMS / "cl_easyvqa"), STRANGER, "--stream", timeout=120)
    assert run.returncode != 0 and "403" in run.stdout + run.stderr
    assert [node["node-id"] for node in nodes(federation)] == [node["node-id"] for node in known]
