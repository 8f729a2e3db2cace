"""The launcher refuses, before Flower starts and in one line naming the key, the value and what
is allowed, every setting it can check on this machine; what passes reaches `flwr run` intact."""

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from config import load_config
from sims import launch as L
from sims.launch import app_config, main, parse_overrides
from strategies.callbacks import RunFolder, write_json_atomically

SIMS = Path(__file__).parents[2] / "sims"
USL = str(SIMS / "usl_easyvqa")


@pytest.fixture
def no_flower(monkeypatch):
    """Fails the test if the launcher got as far as starting `flwr run`; records the command."""
    started = []

    def run(command, **kwargs):
        started.append(command)
        raise AssertionError(f"flwr run started: {command}")

    monkeypatch.setattr(L.subprocess, "run", run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return started


def refusal(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def write_run_folder(root: Path, name: str, rounds_done: int, **overrides) -> None:
    """A run folder as a run with these overrides leaves it after `rounds_done` rounds."""
    config = load_config(app_config(USL, {"output.root": str(root), "output.name": name, **overrides}))
    RunFolder(config, config.run_folder())
    write_json_atomically(config.run_folder() / "committed.json", {"round": rounds_done})


CASES = [
    # (--run-config, extra arguments, what the one line must say)
    ("train.lr=inf", [], ["train.lr=inf", "a finite number"]),
    ("data.alpha=nan", [], ["data.alpha=nan", "a finite number"]),
    ('data.test_split="train"', [], ["data.test_split='train'", "a split other than data.train_split"]),
    ('data.train_split="validation"', [], ["data.train_split='validation'", "train, test"]),
    ("data.train_limit=1 clients.count=2", [], ["data.train_limit=1", "at least clients.count=2"]),
    ("data.test_limit=2 clients.count=3", ["--federation-config", "num-supernodes=3"], ["data.test_limit=2"]),
    ("clients.count=3", ["--federation-config", "num-supernodes=2"], ["clients.count=3", "num-supernodes=2"]),
    ('data.dataset="vqa-rad"', [], ["data.dataset='vqa-rad'", "not in the local Hugging Face cache", "source="]),
    ('data.dataset="vqa-rad" data.source="/no/such/copy"', [], ["'/no/such/copy'", "neither an existing path"]),
    ("train.lrr=0.1", [], ["train.lrr=0.1", "one of the known keys"]),
    ("train.lr=fast", [], ["train.lr=fast", "not a TOML value", 'train.lr="fast"']),
    ("train.rounds", [], ["'train.rounds' is not a KEY=VALUE pair"]),
    ('paradigm="sl" privacy.defenses="grad_noise"', [], ["privacy.defenses='grad_noise'", "usl only"]),
    ("train.rounds=0", [], ["train.rounds=0", ">= 1"]),
    ("faults.timeout_s=-1.0", [], ["faults.timeout_s=-1.0", "> 0 seconds"]),
]
if not torch.cuda.is_available():
    CASES.append(('model.device="cuda"', [], ["model.device='cuda'", "no CUDA device"]))


@pytest.mark.parametrize(("run_config", "extra", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_setting_that_cannot_run_is_refused_in_one_line_before_flower_starts(
        run_config, extra, says, no_flower, capsys, tmp_path):
    line = refusal(capsys, USL, "--run-config", f'{run_config} output.root="{tmp_path}"', *extra)
    for part in says:
        assert part in line, line
    assert not no_flower


def test_a_run_folder_is_continued_only_with_its_own_settings_and_at_least_its_rounds(no_flower, capsys, tmp_path):
    write_run_folder(tmp_path, "done-3", 3, **{"train.lr": 0.001, "train.rounds": 3})
    base = f'output.root="{tmp_path}" output.name="done-3"'
    line = refusal(capsys, USL, "--run-config", f"{base} train.lr=0.01 train.rounds=3")
    assert "train.lr=0.01" in line and "only train.rounds, faults.timeout_s, output.resume, clients.warm_worker, clients.worker_idle_s may change" in line
    line = refusal(capsys, USL, "--run-config", f"{base} train.lr=0.001 train.rounds=2")
    assert "train.rounds=2" in line and ">= 3" in line and "already holds 3 finished rounds" in line
    line = refusal(capsys, USL, "--run-config", f"{base} train.lr=0.001 output.resume=false")
    assert "output.resume=False" in line and "another output.name" in line
    assert not no_flower


def test_the_paper_sim_fails_fast_and_says_what_is_missing(no_flower, capsys, tmp_path):
    line = refusal(capsys, str(SIMS / "usl_vqarad"), "--run-config", f'output.root="{tmp_path}"')
    assert "llava-1.5-7b" in line and "model.source" in line


def test_a_folder_that_is_no_app_and_a_missing_or_torn_toml_file_are_named(no_flower, capsys, tmp_path):
    assert "is not a Flower App folder" in refusal(capsys, str(tmp_path))
    assert "no such TOML file" in refusal(capsys, USL, "--run-config", str(tmp_path / "absent.toml"))
    (tmp_path / "torn.toml").write_text('[train]\nlr = 0.1\nrounds = "')
    assert f"--run-config {tmp_path / 'torn.toml'}: not valid TOML" in refusal(
        capsys, USL, "--run-config", str(tmp_path / "torn.toml"))
    assert "given alone" in refusal(capsys, USL, "--run-config", "train.rounds=2", "--run-config", "more.toml")


def test_overrides_are_read_as_flwr_reads_them_quoted_spaces_and_toml_files_included(tmp_path):
    assert parse_overrides('train.rounds=5 model.source="/data/my llava" output.resume=false') == {
        "train.rounds": 5, "model.source": "/data/my llava", "output.resume": False}
    assert parse_overrides(["train.rounds=5", 'output.name="a b"']) == {"train.rounds": 5, "output.name": "a b"}
    (tmp_path / "run.toml").write_text('paradigm = "sl"\n[train]\nlr = 0.01\n[data]\ntrain_limit = 40\n')
    assert parse_overrides(str(tmp_path / "run.toml")) == {"paradigm": "sl", "train.lr": 0.01, "data.train_limit": 40}


def test_what_passes_reaches_flwr_run_with_one_supernode_per_client(monkeypatch, tmp_path):
    started, real_run = [], subprocess.run

    def run(command, **kwargs):
        if command[0] != "flwr":  # what Ray runs when the launcher first imports it
            return real_run(command, **kwargs)
        started.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(L.subprocess, "run", run)
    (tmp_path / "run.toml").write_text(f'output.root = "{tmp_path}"\noutput.name = "a run"\nclients.count = 3\n'
                                       "data.train_limit = 30\ndata.test_limit = 9\n")
    assert main([USL, "--run-config", str(tmp_path / "run.toml")]) == 1  # flwr wrote no status: not finished
    command = started[0]
    assert command[command.index("--federation-config") + 1] == "num-supernodes=3"
    assert L.parse_overrides(command[command.index("--run-config") + 1])["output.name"] == "a run"
    status, _, _ = L.launch(USL, {"output.root": str(tmp_path), "output.name": "x", "data.train_limit": 30,
                                  "data.test_limit": 9}, "num-supernodes=2 client-resources-num-cpus=1")
    assert started[-1][started[-1].index("--federation-config") + 1] == "num-supernodes=2 client-resources-num-cpus=1"
    assert status["state"] == "unknown" and json.dumps(status)


def test_each_round_is_printed_while_the_run_works(monkeypatch, tmp_path):
    printed, first_printed, real_run = [], threading.Event(), subprocess.run
    metrics = tmp_path / "watched" / "metrics.jsonl"

    def run(command, **kwargs):
        if command[0] != "flwr":
            return real_run(command, **kwargs)
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.write_text(json.dumps({"round": 1, "test_accuracy": 0.795, "test_count": 1000.0, "train_loss": 0.0898,
                                       "wall_s": 169.3}) + "\n")
        assert first_printed.wait(30), "round 1 was not printed while flwr run still ran"
        with metrics.open("a") as handle:  # the last round, then the run ends: printed on the way out
            handle.write(json.dumps({"round": 2, "test_accuracy": 0.8, "test_count": 1000.0}) + "\n")
        return subprocess.CompletedProcess(command, 0, "", "")

    def on_round(line: str) -> None:
        printed.append(line)
        first_printed.set()

    monkeypatch.setattr(L.subprocess, "run", run)
    L.launch(USL, {"output.root": str(tmp_path), "output.name": "watched", "train.rounds": 2, "data.train_limit": 30,
                   "data.test_limit": 9}, on_round=on_round)
    assert printed == ["round 1/2: test accuracy 0.795 (1000 questions), train loss 0.090, 169 s",
                       "round 2/2: test accuracy 0.800 (1000 questions)"]


@pytest.mark.parametrize(("status", "allow", "code"), [
    ({"state": "finished", "complete": True}, False, 0),
    ({"state": "finished", "complete": False, "failed_partitions": {"2": [1]}, "test_share": 0.5}, False, 3),
    ({"state": "finished", "complete": False, "failed_partitions": {"2": [1]}, "test_share": 0.5}, True, 0),
    ({"state": "failed", "error_type": "RuntimeError", "error": "boom"}, True, 1),
], ids=["complete", "partial", "partial-allowed", "failed"])
def test_the_exit_code_says_whether_the_run_finished_with_every_client(status, allow, code, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(L, "launch", lambda *args, **kwargs: (status, tmp_path, subprocess.CompletedProcess([], 0, "", "")))
    assert main([USL, *(["--allow-partial"] if allow else [])]) == code
    if status.get("complete") is False:
        assert "partitions left out by faults, per round: {'2': [1]}; test set scored: 50%" in capsys.readouterr().err


# --- the local SuperLink ----------------------------------------------------------------------

# Stands in for `flower-superlink`: the command line flwr gives it, a /health that answers, and
# "ready" on stdout once it does; SIGTERM ends it as it ends the real one.
STUB_SUPERLINK = '''
import argparse, http.server, sys
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--log-file")
args, _ = parser.parse_known_args()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

server = http.server.HTTPServer(("127.0.0.1", args.port), Health)
print("ready", flush=True)
server.serve_forever()
'''


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.fixture
def superlink_home(monkeypatch, tmp_path):
    """A FLWR_HOME and SuperLink port of the test's own, and a way to start a stub SuperLink on
    them as `flwr run` starts the real one (detached, in its own session); every stub it started
    is ended afterwards, whatever the test did."""
    home, port = tmp_path / "flwr-home", free_port()
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", port)
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "flower-superlink"
    stub.write_text(STUB_SUPERLINK)
    started = []

    def start() -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, str(stub), "--insecure", "--simulation", "--port", port,
             "--log-file", str(home / "local-superlink" / "superlink.log")],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(process)
        assert process.stdout.readline().strip() == "ready"
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def fake_flwr_run(monkeypatch, start, outcome=None):
    """`flwr run` as far as the SuperLink goes: it starts one when none answers, then finishes,
    raises or is interrupted (`outcome`); the launcher's checks and Ray's TLS are skipped."""
    monkeypatch.setattr(L, "preflight", lambda app, overrides, federation="": load_config(app_config(app, overrides)))
    monkeypatch.setattr(L, "simulation_environment", L.installed_tools_environment)
    started = []

    def run(command, **kwargs):
        if not L.LocalSuperLink(kwargs["env"]).serving():
            started.append(start())
        if outcome is not None:
            raise outcome
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(L.subprocess, "run", run)
    return started


@pytest.mark.parametrize("outcome", [None, subprocess.TimeoutExpired("flwr", 1), KeyboardInterrupt()],
                         ids=["returned", "timed-out", "interrupted"])
def test_the_superlink_flwr_run_started_is_stopped_when_the_run_ends(outcome, superlink_home, monkeypatch, tmp_path):
    started = fake_flwr_run(monkeypatch, superlink_home, outcome)
    overrides = {"output.root": str(tmp_path), "output.name": "r"}
    if outcome is None:
        assert L.launch(USL, overrides)[0]["state"] == "unknown"
    else:
        with pytest.raises(type(outcome)):
            L.launch(USL, overrides)
    [superlink] = started
    assert superlink.wait(timeout=30) == -signal.SIGTERM


def test_the_command_line_launcher_leaves_no_superlink_behind_and_says_nothing_of_it(
        superlink_home, monkeypatch, capsys, tmp_path):
    """`make run`'s path: main's context around launch's own."""
    started = fake_flwr_run(monkeypatch, superlink_home)
    assert main([USL, "--run-config", f'output.root="{tmp_path}"']) == 1  # the fake run wrote no status
    [superlink] = started
    assert superlink.wait(timeout=30) == -signal.SIGTERM
    assert "SuperLink" not in capsys.readouterr().err


def test_a_superlink_running_before_is_left_running_and_the_launcher_says_how_to_stop_it(
        superlink_home, monkeypatch, capsys, tmp_path):
    theirs = superlink_home()
    started = fake_flwr_run(monkeypatch, superlink_home)
    assert main([USL, "--run-config", f'output.root="{tmp_path}"']) == 1  # the fake run wrote no status
    said = [line for line in capsys.readouterr().err.splitlines() if "SuperLink" in line]
    assert started == [] and theirs.poll() is None
    assert len(said) == 1 and "left running" in said[0] and f"`kill {theirs.pid}` stops it" in said[0], said


def test_an_open_context_holds_the_superlink_across_runs_and_the_last_to_close_stops_it(
        superlink_home, monkeypatch, tmp_path):
    """As a sweep runs its points, or a second launcher's run goes on (its own lock on the same
    file): the first run starts the SuperLink, the next ones use it, and the end of a run inside
    does not stop it under the others."""
    started = fake_flwr_run(monkeypatch, superlink_home)
    with L.LocalSuperLink() as held:
        for name in ("a", "b"):
            L.launch(USL, {"output.root": str(tmp_path), "output.name": name})
            assert len(started) == 1 and started[0].poll() is None
        assert held.notice() is None
    assert started[0].wait(timeout=30) == -signal.SIGTERM
    assert held.stopped == [started[0].pid]


def test_the_superlink_flwr_starts_is_recognised_and_stopped(tmp_path):
    """The real `flower-superlink`, started by flwr's own code as `flwr run` starts it (a few
    seconds: its start is what is tested), so the command line the launcher looks for is flwr's."""
    environment = {**L.installed_tools_environment(), "FLWR_HOME": str(tmp_path),
                   "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": free_port(), "FLWR_LOCAL_CONTROL_API_PORT": free_port()}
    # flwr gives the SuperLink 15 s to answer, which a cold start on a loaded 2-core machine can
    # outlast (it failed so once in CI); what is tested is the command line it starts, so it gets 120.
    start = ("import flwr.cli.local_superlink as local\n"
             "from flwr.cli.typing import SuperLinkConnection\n"
             "local.LOCAL_SUPERLINK_STARTUP_TIMEOUT = 120.0\n"
             "local.ensure_local_superlink(SuperLinkConnection(name='local', address=':local:'))\n")
    try:
        with L.LocalSuperLink(environment) as superlink:
            started = subprocess.run([sys.executable, "-c", start], env=environment, capture_output=True, text=True,
                                     timeout=240)
            assert started.returncode == 0, started.stderr[-3000:]
            assert superlink.serving()
        assert len(superlink.stopped) == 1
        assert not superlink.serving() and L._superlinks(tmp_path) == []
    finally:
        L.stop_local_superlink(tmp_path)  # a failed check leaves nothing running either
