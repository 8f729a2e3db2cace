"""The deployment recipe of sims/deploy.py, every process on this machine: the SuperLink (TLS,
SuperNode authentication), the nginx gateway and registered SuperNodes, started with the
operator's environment and stopped on exit. The deployment tests and the deployment round-trip
benchmark run on it; it is also the quickest way to try the recipe before spreading it out.

    with LoopbackFederation(folder, nodes=2) as federation:
        federation.flwr("run", "sims/usl_easyvqa", CONNECTION, "--stream")
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from sims.deploy import CONNECTION, Deployment, init
from sims.launch import installed_tools_environment

# The connection of someone who reaches only the gateway (what a stranger on the network has).
STRANGER = "gateway"


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


def command_lines() -> dict[int, list[str]]:
    """Every process's arguments, by process id (those that ended while being read left out)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found[int(cmdline.parent.name)] = cmdline.read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:  # the process ended meanwhile
            continue
    return found


def stop_processes_naming(*markers: str) -> None:
    """Kill the processes whose command line holds one of `markers` (a path, a port that only
    they name) and their descendants: a SuperExec detaches from its SuperLink or SuperNode, and
    Ray's agents rename themselves, so neither is reachable as a child of what was started."""
    parents, matched = {}, set()
    for pid, args in command_lines().items():
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        line = " ".join(args) + " "  # markers may end in a space: "--port 9094 "
        if any(marker in line for marker in markers) and pid != os.getpid():
            matched.add(pid)
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in matched} - matched
        grew = bool(children)
        matched |= children
    for pid in matched:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LoopbackFederation:
    """A deployment written to `folder` and run here: `nodes` SuperNodes (partition i holds key
    i and state-dir `folder/state<i>`) joined through the gateway; the operator's `flwr` uses
    $FLWR_HOME in the folder, with the `deploy` connection and the stranger's `gateway` one."""

    def __init__(self, folder: Path, nodes: int, online_timeout: float = 120.0) -> None:
        self.folder, self.online_timeout = Path(folder), online_timeout
        self.deployment: Deployment = init(folder, nodes=nodes, public=f"127.0.0.1:{free_port()}", superlink_port=free_port())
        self.home = self.folder / "flwr-home"
        self.env = {**installed_tools_environment(), "FLWR_HOME": str(self.home)}
        self.processes: list[subprocess.Popen] = []
        # Each registered SuperNode's command line, by partition (a caller may restart one).
        self.node_commands: list[list[str]] = []

    def __enter__(self) -> "LoopbackFederation":
        deployment = self.deployment
        self.home.mkdir(exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n' + deployment.connection()
            + deployment.connection(STRANGER, address=deployment.public))
        try:
            link, link_log = self.start("superlink", deployment.superlink_command())
            wait_for_port(deployment.superlink_port, link, link_log)
            gateway, gateway_log = self.start("gateway", deployment.gateway_command())
            wait_for_port(int(deployment.public.rsplit(":", 1)[1]), gateway, gateway_log)
            for partition in range(deployment.nodes):
                registered = self.flwr("supernode", "register", str(deployment.node_key(partition)[1]), CONNECTION)
                if registered.returncode != 0:
                    raise RuntimeError(f"registering node {partition} failed: {registered.stdout}{registered.stderr}")
                self.node_commands.append(
                    deployment.supernode_command(partition, free_port(), self.folder / f"state{partition}"))
                self.node(f"node{partition}", self.node_commands[partition])
            deadline = time.monotonic() + self.online_timeout
            while len(self.online_nodes()) < deployment.nodes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self.online_nodes())} of {deployment.nodes} SuperNodes online "
                                       f"after {self.online_timeout}s; see {self.folder}/node*.log")
                time.sleep(1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_) -> None:
        stop_processes_naming(str(self.folder), self.deployment.superlink,
                              *(f"127.0.0.1:{c[c.index('--port') + 1]}" for c in self.node_commands))
        for process in self.processes:
            process.wait(timeout=30)

    def start(self, name: str, command: list[str]) -> tuple[subprocess.Popen, Path]:
        """`command` started in its own session, its output in `folder/<name>.log`."""
        log = self.folder / f"{name}.log"
        process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=self.env,
                                   start_new_session=True)
        self.processes.append(process)
        return process, log

    def node(self, name: str, command: list[str], retries: int | None = None) -> tuple[subprocess.Popen, Path]:
        return self.start(name, [*command, *(["--max-retries", str(retries)] if retries is not None else [])])

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["flwr", *args], capture_output=True, text=True, env=self.env, timeout=timeout)

    def run(self, app: Path, run_config: str) -> subprocess.Popen:
        """`flwr run` of `app` on the deployment with `run_config`, its output streamed into a pipe."""
        return subprocess.Popen(["flwr", "run", str(app), CONNECTION, "--stream", "--run-config", run_config],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)

    def runtime_port(self, partition: int) -> str:
        """The Runtime API port of SuperNode `partition`, which the processes serving it name."""
        command = self.node_commands[partition]
        return command[command.index("--port") + 1]

    def nodes(self) -> list[dict]:
        """Every SuperNode the SuperLink knows, as the operator lists them."""
        listed = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        return json.loads(listed.stdout)["nodes"]

    def online_nodes(self) -> list[dict]:
        return [node for node in self.nodes() if node["status"] == "online"]
