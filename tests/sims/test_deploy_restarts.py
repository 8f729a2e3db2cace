"""The deployment recipe of sims/deploy.py on loopback when its processes go away: FL goes on
without a node killed mid-round, which then rejoins as itself, and a run resumes after the
SuperLink restarts from its database. On a federation of its own (tests/sims/conftest.py), not
test_deploy.py's: both tests restart its processes, and the two files' waits run side by side.

Slow by nature: each `flwr run` cold-starts a warm worker on each node (about 15 s on 2 cores,
over 30 s under load), the dead node is waited out for Flower's heartbeat patience (2 x 30 s), and
the restarted SuperLink waits for its SuperNodes to come back."""

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest

from sims.loopback import command_lines, wait_for_port

pytestmark = [pytest.mark.deployment, pytest.mark.long_file,
              pytest.mark.skipif(shutil.which("nginx") is None,
                                 reason="nginx is not installed (scripts/setup.sh installs it where apt-get is available)")]
SIMS = Path(__file__).parents[2] / "sims"


def test_fl_goes_on_without_a_node_killed_mid_round_and_the_node_rejoins_as_itself(
        federation, small_run, tmp_path, stop_processes_naming):
    # The round learns of the dead node from the SuperLink, which answers for a node whose heartbeat
    # has stopped (36-60 s after it died), so faults.timeout_s only bounds; it also bounds the
    # partition queries, which cold-start each node's warm worker: over 30 s on a loaded machine.
    run = federation.run(SIMS / "fl_easyvqa", small_run("killed", **{"faults.timeout_s": 300.0}))
    node = federation.node_commands[1]
    port = federation.runtime_port(1)
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


def test_a_run_resumes_after_the_superlink_restarts_from_its_database(
        federation, small_run, tmp_path, stop_processes_naming):
    deployment = federation.deployment
    # The resumed run's first messages cold-start new warm workers while the first run's may still finish the
    # round it was killed in: on a loaded machine that outlasts a minute, so no message is judged hung
    # before a worker could have started (clients.worker.START_TIMEOUT_S).
    config = small_run("restarted", **{"train.rounds": 2, "faults.timeout_s": 300.0})
    first = federation.run(SIMS / "fl_easyvqa", config)
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
    again = federation.run(SIMS / "fl_easyvqa", config)
    again.communicate(timeout=600)
    status = json.loads((tmp_path / "restarted" / "status.json").read_text())
    assert status["state"] == "finished" and status["complete"], status
    assert [json.loads(line)["round"] for line in metrics.read_text().splitlines()] == [1, 2]
