"""End-to-end: the sims through the real `flwr run` (simulation runtime, Ray).

Slow: each run starts Ray (or a Ray job) and client actors that import torch, about 40 s on
2 cores whatever the run's size, so there are four: a sweep's point, a SecAgg+ run with central
DP, and two runs of one SL config (one on the simulation's own Ray, one on an existing cluster)
whose outcomes must agree, which three tests read. Each is judged by the run folder's status,
since `flwr run --stream` exits 0 either way. The module has its own FLWR_HOME and ports, and
stops the SuperLinks and Ray clusters it started.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from hashlib import sha256
from pathlib import Path
from types import SimpleNamespace

import pytest

from attacks import Recording
from sims.launch import (LocalSuperLink, installed_tools_environment, launch, simulation_environment,
                         stop_local_superlink)
from sims.loopback import stop_processes_naming
from sims.sweep import main as sweep_main

pytestmark = [pytest.mark.flwr_run, pytest.mark.long_file]
SIMS = Path(__file__).parents[2] / "sims"
RAY_PORT = 6391


@pytest.fixture(scope="module")
def flwr_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    saved = {k: os.environ.get(k) for k in ("FLWR_HOME", "FLWR_LOCAL_CONTROL_API_PORT", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT")}
    os.environ.update(FLWR_HOME=str(home), FLWR_LOCAL_CONTROL_API_PORT="29293", FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="29294")
    with LocalSuperLink():  # one SuperLink for the module's runs, stopped after the last
        yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_a_sweep_runs_its_point_through_flwr_run_and_replays_the_recording(flwr_home, tmp_path):
    """The sweep's default runner: the point's run goes through `flwr run` (two round trips per
    USL step), with defenses in the vision edge and at both cuts, and its attack replays on what
    the server recorded."""
    sweep_file = tmp_path / "sweep.toml"
    sweep_file.write_text(f"""
[sweep]
sim = "{SIMS / 'usl_easyvqa'}"
[fixed]
"model.profile" = "tiny"
"data.train_limit" = 24
"data.test_limit" = 6
"train.rounds" = 2
"train.steps_per_round" = 4
"train.batch_size" = 4
"eval.batch_size" = 4
"eval.every" = 2
"threat.model" = "passive"
"threat.aux_limit" = 8
"privacy.defenses" = "shuffle,noise,grad_topk"
"privacy.noise.variance" = 1e-6
"privacy.grad_topk.ratio" = 0.5
[[grid]]
name = "usl"
product = {{ paradigm = ["usl"] }}
[attacks.actinv]
options = {{ iterations = 100, max_transfers = 2 }}
""")
    assert sweep_main(["run", str(sweep_file), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    folder = tmp_path / "out" / "runs" / "usl-usl"
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert records[0]["round_trips_per_step"] == pytest.approx((2 * 4 + 1) / 4)
    assert records[1]["test_count"] == 6
    # Under flwr run node ids are not partition ids; the run folder's nodes.json says which node held which.
    recording = Recording.open(folder)
    nodes = {e.client for e in recording.entries}
    assert len(nodes) == 2 and not nodes <= {1, 2}
    assert [d["name"] for d in json.loads((folder / "status.json").read_text())["defenses"]] == ["shuffle", "noise", "grad_topk"]
    for entry in recording.entries:
        if entry.kind == "gradient at CB" and entry.stored:
            grad = recording.tensors(entry)["grad"]
            assert int((grad == 0).sum()) >= grad.numel() // 2  # top-k ran on the client, per sample
    result = json.loads((folder / "attacks" / "actinv.json").read_text())
    assert result["metrics"]["token_recall"] > 0.9


@pytest.fixture(scope="module")
def sl_runs(flwr_home, tmp_path_factory):
    """Two `flwr run`s of one SL config, which three tests read: the first on the Ray the
    simulation starts (its TLS settings read while it runs), the second with RAY_ADDRESS naming an
    existing cluster. A run costs about 40 s on 2 cores whatever its size (Ray or a Ray job, and
    actors that import torch), so the tests share these two."""
    root = tmp_path_factory.mktemp("sl-runs")
    overrides = {
        "privacy.defenses": "noise", "privacy.noise.variance": 1e-4,
        "privacy.dp.mode": "sgd", "privacy.dp.noise_multiplier": 1.0, "privacy.dp.delta": 1e-3,
        "model.profile": "tiny", "data.train_limit": 24, "data.test_limit": 4, "train.rounds": 1,
        "train.steps_per_round": 2, "train.batch_size": 4, "eval.batch_size": 4, "eval.every": 1,
        "output.root": str(root),
    }
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(launch, SIMS / "sl_easyvqa", {**overrides, "output.name": "own-ray"},
                          "num-supernodes=2 client-resources-num-cpus=1", 240)
        own_ray_tls = tls_of_the_runs_ray(flwr_home / "ray-tls", run)
        own = run.result()
    return SimpleNamespace(own=own, own_ray_tls=own_ray_tls, cluster=run_on_existing_cluster(
        SIMS / "sl_easyvqa", {**overrides, "output.name": "on-cluster"}, root))


def test_two_flwr_runs_of_one_config_give_the_same_weights_and_metrics(sl_runs, assert_same_outcome):
    """Flower gives the supernodes new random ids each run; clients take turns by partition, and
    their random draws (a defense's noise, DP-SGD's batches and noise) go by partition, round and
    step, so an SL run with them repeats too: here once on the simulation's own Ray and once on
    an existing cluster."""
    folders = []
    for status, folder, process in (sl_runs.own, sl_runs.cluster.launched):
        assert status["state"] == "finished", status.get("error", process.stdout[-2000:])
        folders.append(folder)
    first_nodes, second_nodes = (json.loads((f / "nodes.json").read_text()) for f in folders)
    assert sorted(first_nodes.values()) == sorted(second_nodes.values()) == [0, 1]
    assert first_nodes.keys() != second_nodes.keys()  # the node ids did change
    assert_same_outcome(*folders)


def test_fl_runs_secagg_with_central_dp_under_flwr_run(flwr_home, tmp_path):
    """SecAgg+'s four stages through Flower's simulation runtime (each node's protocol state kept
    between them), with the clients clipping and the server noising the sum to a target epsilon."""
    overrides = {
        "model.profile": "tiny", "data.train_limit": 24, "data.test_limit": 4, "train.rounds": 2,
        "train.steps_per_round": 2, "train.batch_size": 4, "eval.every": 0, "clients.count": 3,
        "privacy.secagg.enabled": True, "privacy.dp.mode": "central-client-clipping", "privacy.dp.target_epsilon": 8.0,
        "privacy.dp.delta": 1e-3, "output.root": str(tmp_path), "output.name": "secagg-dp",
    }
    status, folder, process = launch(SIMS / "fl_easyvqa", overrides, "num-supernodes=3 client-resources-num-cpus=1",
                                     timeout_s=240)
    assert status["state"] == "finished", status.get("error", process.stdout[-2000:])
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [(r["clients_averaged"], r["round_trips_train"], r["faults"]) for r in records] == [(3, 4, [])] * 2
    assert status["privacy_spent"]["dp_epsilon"] == pytest.approx(8.0, abs=0.01) == records[-1]["dp_epsilon"]


def test_the_simulations_ray_refuses_anyone_without_its_certificate(sl_runs, flwr_home):
    """Ray listens on every interface; the launcher's mutual TLS keeps strangers off it. The SL
    run's own Ray started with the launcher's TLS settings, which Ray takes from these variables
    (and the files they name) alone; a Ray started here with the same settings, which lives until
    the probes end as a short run's Ray would not, admits their holder and refuses a stranger.
    Slow (about 30 s): Ray's start, and the stranger's 2 x 10 s of connection timeouts."""
    tls = {key: value for key, value in simulation_environment().items()
           if key.startswith("RAY_TLS_") or key == "RAY_USE_TLS"}
    assert tls["RAY_USE_TLS"] == "1" and sl_runs.own_ray_tls == tls_settings(tls)
    with ray_cluster(RAY_PORT + 1, tls) as ray_dir:
        pid, address = ray_gcs_server(flwr_home / "ray-tls", started_in=ray_dir)
        holder = join_ray(address, tls)
        assert holder.returncode == 0, holder.stdout[-2000:]  # the certificate's holder joins
        stranger = join_ray(address, {})
        assert stranger.returncode != 0 and Path(f"/proc/{pid}").exists(), stranger.stdout[-2000:]


def tls_of_the_runs_ray(tls_folder: Path, run) -> dict[str, str] | None:
    """tls_settings of the Ray GCS server that `run` starts with the certificates in
    `tls_folder`, read once it appears (None if the run ends first)."""
    while not run.done():
        gcs = ray_gcs_server(tls_folder)
        if gcs is not None:
            try:
                return tls_settings(ray_tls_variables(gcs[0]))
            except OSError:  # it ended meanwhile
                continue
        time.sleep(0.2)
    return None


def tls_settings(variables: dict[str, str]) -> dict[str, str]:
    """Ray's TLS variables, with the digest of each file they name."""
    return {**variables, **{f"{key} sha256": sha256(Path(value).read_bytes()).hexdigest()
                            for key, value in variables.items() if key.startswith("RAY_TLS_")}}


def ray_tls_variables(pid: int) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
    return {key: value for key, value in pairs if key.startswith("RAY_TLS_") or key == "RAY_USE_TLS"}


def ray_gcs_server(tls_folder: Path, started_in: Path | None = None) -> tuple[int, str] | None:
    """(pid, node-ip:port) of a Ray GCS server started with the certificates in `tls_folder`
    (and, if given, with its session under `started_in`)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"RAY_TLS_CA_CERT={tls_folder}" not in environ.read_bytes().decode(errors="replace"):
                continue
            args = (environ.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
        if not args[0].endswith("gcs_server") or (started_in is not None and str(started_in) not in " ".join(args)):
            continue
        ip = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--node-ip-address="))
        ports = listening_ports(int(environ.parent.name))
        if ports:
            return int(environ.parent.name), f"{ip}:{min(ports)}"
    return None


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def join_ray(address: str, tls: dict[str, str]) -> subprocess.CompletedProcess:
    """A driver joining the Ray cluster at `address` with these TLS variables (none: a stranger)."""
    environment = {key: value for key, value in installed_tools_environment().items() if not key.startswith("RAY_")}
    environment.update(tls, RAY_gcs_rpc_server_connect_timeout_s="10", RAY_gcs_rpc_server_reconnect_timeout_s="10")
    code = f"import ray; ray.init(address={address!r}, logging_level='ERROR'); ray.shutdown()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)


def test_the_sim_runs_its_clients_on_an_existing_ray_cluster(sl_runs):
    """RAY_ADDRESS in the environment that starts the SuperLink sends the clients to that cluster."""
    status, _, process = sl_runs.cluster.launched
    assert status["state"] == "finished", status.get("error", process.stdout[-2000:])
    # Ray writes a worker's logs into the cluster's own session: the client actors ran there.
    assert any("ClientAppActor" in log for log in sl_runs.cluster.worker_logs)


def run_on_existing_cluster(app: Path, overrides: dict, root: Path) -> SimpleNamespace:
    """`app` launched with RAY_ADDRESS naming a Ray cluster started for it (and a SuperLink of
    its own, which must start with that variable): what launch returned, and the cluster's
    worker logs, read before the cluster is stopped."""
    home = root / "flwr-home-cluster"
    with ray_cluster(RAY_PORT) as ray_dir, pytest.MonkeyPatch.context() as environment:
        environment.setenv("RAY_ADDRESS", f"127.0.0.1:{RAY_PORT}")
        environment.setenv("FLWR_HOME", str(home))
        environment.setenv("FLWR_LOCAL_CONTROL_API_PORT", "29693")
        environment.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "29694")
        try:
            launched = launch(app, overrides, "num-supernodes=2 client-resources-num-cpus=1", timeout_s=240)
        finally:
            stop_local_superlink(home)
        logs = [path.read_text(errors="replace") for path in ray_dir.glob("session_latest/logs/worker-*.out")]
    return SimpleNamespace(launched=launched, worker_logs=logs)


@contextmanager
def ray_cluster(port: int, environment: dict[str, str] | None = None) -> Iterator[Path]:
    """A Ray head on `port` (`ray start`, with `environment` over the installed tools'), stopped
    on exit; yields its temp dir. Started in a session of its own, as a cluster someone else runs
    would be: Ray starts its workers at nice 15, which in this session's scheduling group would
    leave them next to nothing beside the busy test workers on a loaded machine."""
    # Ray's socket paths must stay under 107 bytes, which pytest's tmp_path can exceed.
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        subprocess.run(
            ["ray", "start", "--head", "--port", str(port), "--num-cpus", "2", "--temp-dir", str(ray_dir),
             "--include-dashboard=false", "--disable-usage-stats"],
            check=True, capture_output=True, timeout=120, env={**installed_tools_environment(), **(environment or {})},
            start_new_session=True,
        )
        yield ray_dir
    finally:
        stop_processes_naming(str(ray_dir), f"{port} --host")
        shutil.rmtree(ray_dir, ignore_errors=True)
