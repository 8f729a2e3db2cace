"""Run a simulation with `flwr run` and report what its run folder says.

`flwr run --stream` exits 0 even when the ServerApp failed, so this wrapper reads
the run folder's status.json and exits non-zero unless the run finished (1), or when it
finished without every client (3, unless --allow-partial):

    python -m sims.launch sims/usl_easyvqa [--run-config 'train.rounds=5'] [--federation-config 'num-supernodes=2']
    python -m sims.launch sims/usl_easyvqa --run-config my-run.toml   # a TOML file of overrides

Before Flower starts, everything the run can check here is checked (`preflight`): the config's
values, the run folder it would resume, the data it would load, the device and the number of
SuperNodes; a problem is one line naming the key, the value and what is allowed (exit 2).

`flwr run` starts a local SuperLink on first use and leaves it running; the launcher stops the
one it caused to start when the run ends, fails or is interrupted (Ctrl-C, SIGTERM). A SuperLink
that was already running is left as it is, and the launcher says so, with how to stop it.
"""

import argparse
import fcntl
import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from flwr.common.config import parse_config_args

from config import RESUMABLE_KEYS, ConfigError, SimConfig, load_config
from sims.deploy import ray_tls_environment
from strategies.callbacks import LIVE_STATES, changed_since_written, committed_round
from training.data import RunData
from vlm.loading import ModelNotAvailableError, locate_weights

# How flwr reads one KEY=VALUE pair of --run-config (flwr.common.config.parse_config_args).
PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")
NUM_SUPERNODES = "num-supernodes"


class LaunchError(ValueError):
    """A launch that cannot start; the message is one line naming what to change."""


def app_config(app_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The app's run config with `overrides` applied, as the ServerApp will see it."""
    project = Path(app_dir) / "pyproject.toml"
    if not project.is_file():
        raise LaunchError(f"{app_dir} is not a Flower App folder (no pyproject.toml); the sims are in sims/")
    return {**_declared_config(str(project.resolve()), project.stat().st_mtime_ns), **(overrides or {})}


@functools.lru_cache(maxsize=32)
def _declared_config(project: str, modified_ns: int) -> dict[str, Any]:
    """The run config an app's pyproject.toml declares; read once per version of the file (a sweep
    asks for it at every point)."""
    return tomllib.loads(Path(project).read_text())["tool"]["flwr"]["app"]["config"]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def parse_overrides(arguments: str | list[str]) -> dict[str, Any]:
    """--run-config as `flwr run` reads it: KEY=VALUE pairs with TOML values (a quoted string
    may hold spaces), or one TOML file. A pair TOML cannot read, a word that is no pair, and a
    missing or torn file are refused naming them."""
    items = [item for item in ([arguments] if isinstance(arguments, str) else arguments) if item.strip()]
    if len(items) == 1 and items[0].strip().endswith(".toml"):
        path = Path(items[0].strip()).expanduser()
        if not path.is_file():
            raise LaunchError(f"--run-config {items[0]}: no such TOML file")
        try:
            return parse_config_args([str(path)])
        except ValueError as error:  # flwr reads it with tomli, whose decode error is a ValueError
            raise LaunchError(f"--run-config {path}: not valid TOML ({error})") from None
    for item in items:
        if item.strip().endswith(".toml"):
            raise LaunchError(f"--run-config {item}: a TOML file is given alone, not beside KEY=VALUE pairs")
        stray = PAIR.sub(" ", item).split()
        if stray:
            raise LaunchError(f"--run-config: {stray[0]!r} is not a KEY=VALUE pair (string values take double "
                              'quotes: model.source="/data/my models")')
        for key, value in PAIR.findall(item):
            try:
                tomllib.loads(f"v = {value}")
            except tomllib.TOMLDecodeError:
                raise LaunchError(f"--run-config {key}={value}: not a TOML value (strings take double quotes: "
                                  f'{key}="{value}"; numbers and true/false none)') from None
    return parse_config_args(items)


def supernodes(federation_config: str) -> int | None:
    """num-supernodes from --federation-config (None: not given)."""
    for key, value in PAIR.findall(federation_config):
        if key == NUM_SUPERNODES:
            if not value.isdigit():
                raise LaunchError(f"--federation-config {key}={value}: a positive integer")
            return int(value)
    return None


def preflight(app_dir: str | Path, overrides: dict[str, Any] | None, federation_config: str = "") -> SimConfig:
    """The run's validated config after every check this machine can make before Flower starts;
    raises ConfigError (naming key, value, allowed), ModelNotAvailableError or LaunchError."""
    config = load_config(app_config(app_dir, overrides))
    nodes = supernodes(federation_config)
    if nodes is not None and nodes != config.clients.count:
        raise ConfigError("clients.count", config.clients.count,
                          f"the number of SuperNodes, {NUM_SUPERNODES}={nodes} (--federation-config)")
    _check_resume(config)
    # Real weights (llava-1.5-7b) found locally, without loading them: ModelNotAvailableError says how to supply them.
    locate_weights(config.model.profile, stage=config.model.stage, source=config.model.source or None)
    if config.model.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("model.device", "cuda", "auto or cpu: this machine, where the simulation's clients "
                              "run, has no CUDA device")
    try:
        RunData.build(config)
    except ValueError as error:
        data = config.data
        raise LaunchError(f"run config data.dataset={data.dataset!r} data.source={data.source!r} "
                          f"(splits {data.train_split!r}/{data.test_split!r}): {error}") from None
    return config


def _check_resume(config: SimConfig) -> None:
    """What the run folder it would continue allows: its own settings, and at least its rounds."""
    folder = config.run_folder()
    done = committed_round(folder)
    if not done:
        return
    if not config.output.resume:
        raise ConfigError("output.resume", False, f"true to continue {folder}, which holds {done} finished "
                          "round(s), or another output.name")
    changed = changed_since_written(config, folder)
    if changed:
        written = json.loads((folder / "config.json").read_text())["config"]
        key = changed[0]
        raise ConfigError(key, config.to_flat()[key], f"{written.get(key)!r} as {folder} was written with (changed "
                          f"now: {', '.join(changed)}); only {', '.join(RESUMABLE_KEYS)} may change on resume — "
                          "or choose another output.name")
    if config.train.rounds < done:
        raise ConfigError("train.rounds", config.train.rounds, f">= {done}: {folder} already holds {done} finished "
                          "rounds (raise it to extend the run)")


def installed_tools_environment() -> dict[str, str]:
    """This environment with the interpreter's scripts folder first on PATH.

    `flwr` (and the SuperLink it starts) are console scripts of the virtualenv that runs
    this module; without this, an un-activated `.venv/bin/python -m sims.launch` (as
    `make test` runs it) would not find them.
    """
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")])}


def simulation_environment() -> dict[str, str]:
    """The environment `flwr run` starts the simulation with: the installed tools, and Ray's
    mutual TLS (sims.deploy.ray_tls_environment, kept in $FLWR_HOME/ray-tls) unless RAY_ADDRESS
    names an existing cluster, which keeps its own settings."""
    environment = installed_tools_environment()
    if environment.get("RAY_ADDRESS"):
        return environment
    # Ray is imported only here, for the address it will dial: in-process sweeps and the
    # deployment tools import this module without ever starting Ray.
    from ray.util import get_node_ip_address

    home = Path(environment.get("FLWR_HOME") or Path.home() / ".flwr")
    hosts = ["localhost", "127.0.0.1", get_node_ip_address()]
    return {**environment, **ray_tls_environment(home / "ray-tls", hosts)}


class RoundWatcher:
    """Hands each round line metrics.jsonl gains to `on_round` while a run works: `flwr run`'s
    own output comes back only when it ends, and a run of five rounds takes many minutes.
    Polls once a second (the file is written by another process; nothing else signals it)."""

    def __init__(self, metrics: Path, on_round: Callable[[dict[str, Any]], None], every_s: float = 1.0) -> None:
        self.metrics, self.on_round, self.every_s = metrics, on_round, every_s
        self._seen = self._lines()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="round-watcher", daemon=True)

    def _lines(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.is_file() else 0

    def _report_new(self) -> None:
        lines = self.metrics.read_text().splitlines() if self.metrics.is_file() else []
        if len(lines) < self._seen:  # a resumed run dropped lines past its checkpoint
            self._seen = len(lines)
        for line in lines[self._seen:]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return  # a line still being written: read it whole on the next poll
            self.on_round(record)
            self._seen += 1

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self._report_new()

    def __enter__(self) -> "RoundWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._report_new()


def round_line(record: dict[str, Any], rounds: int) -> str:
    """One round of metrics.jsonl as the launcher prints it."""
    parts = []
    if record.get("test_accuracy") is not None:
        parts.append(f"test accuracy {record['test_accuracy']:.3f} ({int(record.get('test_count') or 0)} questions)")
    if record.get("train_loss") is not None:
        parts.append(f"train loss {record['train_loss']:.3f}")
    if record.get("wall_s") is not None:
        parts.append(f"{record['wall_s']:.0f} s")
    return f"round {record.get('round')}/{rounds}: " + ", ".join(parts)


def launch(
    app_dir: str | Path, overrides: dict[str, Any] | None = None, federation_config: str = "", timeout_s: float = 3600,
    *, on_round: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], Path, subprocess.CompletedProcess]:
    """Run the app after its preflight (the SuperNodes default to clients.count); returns
    (status.json contents, run folder, the finished `flwr run` process). `on_round(line)` gets
    each round as it ends, a readable line (round_line).

    The local SuperLink `flwr run` starts for it is stopped when `flwr run` returns, raises or
    is interrupted, unless an enclosing `LocalSuperLink` context holds it for more runs."""
    config = preflight(app_dir, overrides, federation_config)
    if supernodes(federation_config) is None:
        federation_config = f"{NUM_SUPERNODES}={config.clients.count} {federation_config}".strip()
    folder = config.run_folder()
    status_file = folder / "status.json"
    previous = status_file.stat().st_mtime_ns if status_file.exists() else None
    command = ["flwr", "run", str(app_dir), "--stream", "--federation-config", federation_config]
    if overrides:
        command += ["--run-config", " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())]
    environment = simulation_environment()
    rounds = config.train.rounds
    watcher = (nullcontext() if on_round is None
               else RoundWatcher(folder / "metrics.jsonl", lambda record: on_round(round_line(record, rounds))))
    with LocalSuperLink(environment), watcher:
        process = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environment)
    if not status_file.exists() or status_file.stat().st_mtime_ns == previous:
        status = {"state": "unknown", "error": f"the run wrote no status to {status_file}; flwr said:\n{process.stdout[-3000:]}{process.stderr[-3000:]}"}
    else:
        status = json.loads(status_file.read_text())
        if status.get("state") in LIVE_STATES:
            status = {**status, "state": "stopped", "error_type": "ServerStopped",
                      "error": f"flwr run returned while the run still said {status['state']!r}: its server was "
                               "killed or stopped (`flwr stop`); run the same command again to resume it"}
    return status, folder, process


# flwr.cli.constant's default for FLWR_LOCAL_SUPERLINK_HTTP_API_PORT.
LOCAL_SUPERLINK_PORT = "39091"
SUPERLINK_STOP_S = 30.0


def _superlinks(flwr_home: str | Path, port: str | None = None) -> list[int]:
    """Ids of the local SuperLinks `flwr run` started for `flwr_home` (and `port`, if given).

    `flwr run` starts it detached as `flower-superlink ... --port PORT --log-file
    FLWR_HOME/local-superlink/superlink.log` (flwr.cli.local_superlink), so its command line
    names both; nothing else records its id.
    """
    log_file = str(Path(flwr_home) / "local-superlink" / "superlink.log")
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended meanwhile
            continue
        if not any(Path(arg).name == "flower-superlink" for arg in args[:2]):
            continue
        options = dict(zip(args, args[1:]))
        if options.get("--log-file") == log_file and (port is None or options.get("--port") == port):
            found.append(int(cmdline.parent.name))
    return found


def _stop(pid: int, timeout_s: float = SUPERLINK_STOP_S) -> None:
    """SIGTERM (the SuperLink then stops its SuperExec and the run's processes), SIGKILL if it
    is still there after `timeout_s`; returns once it has exited.

    Through a pidfd where Linux has one: the signal cannot reach a process that took over the
    id, and its exit is an event to wait on rather than a state to poll.
    """
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (old kernel or another OS)
        handle = None
    try:
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, timeout_s)):
            try:
                if handle is None:
                    os.kill(pid, sig)
                else:
                    signal.pidfd_send_signal(handle, sig)
            except (ProcessLookupError, PermissionError):  # gone, or another user's
                return
            if _exited(pid, handle, wait_s):
                return
    finally:
        if handle is not None:
            os.close(handle)


def _exited(pid: int, handle: int | None, timeout_s: float) -> bool:
    if handle is not None:
        poller = select.poll()
        poller.register(handle, select.POLLIN)  # readable once the process has exited
        return bool(poller.poll(timeout_s * 1000))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not Path(f"/proc/{pid}/cmdline").read_bytes():
                return True  # a zombie: its command line reads empty
        except OSError:
            return True
        time.sleep(0.05)
    return False


def stop_local_superlink(flwr_home: str | Path) -> list[int]:
    """Stop every local SuperLink `flwr run` started for `flwr_home`, whatever its port, and wait
    for each to exit; returns their ids."""
    stopped = _superlinks(flwr_home)
    for pid in stopped:
        _stop(pid)
    return stopped


class LocalSuperLink:
    """The local SuperLink that `flwr run` starts on first use, detached, and leaves running.

    Used as a context around `flwr run`s: on exit it stops the SuperLink a launcher started for
    this FLWR_HOME and port, whether the run finished, failed or was interrupted. Launchers share
    it, as `flwr run`s do: each open context holds a shared lock on `LOCK_FILE` beside
    the SuperLink's log, the SuperLinks that appeared while a context was open are listed in
    `STARTED_FILE`, and the last context to close stops them; so a sweep's context holds one
    SuperLink across its points, and a second launcher's run is not cut short by the first's end.
    A SuperLink that no launcher started (a plain `flwr run`'s, the user's) is left running:
    `notice()` says so and how to stop it.
    """

    LOCK_FILE = "launchers.lock"
    STARTED_FILE = "launcher-started.json"

    def __init__(self, environment: dict[str, str] | None = None):
        environment = os.environ if environment is None else environment
        self.home = Path(environment.get("FLWR_HOME") or Path.home() / ".flwr")
        self.port = environment.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT") or LOCAL_SUPERLINK_PORT
        self.folder = self.home / "local-superlink"  # where flwr keeps its log
        self.serving_before = False
        self.before: set[int] = set()
        self.stopped: list[int] = []
        self._lock = None

    def serving(self) -> bool:
        """Whether a SuperLink answers on the port: `flwr run` then uses it and starts none."""
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{self.port}/health", timeout=1):
                return True  # urllib raises for anything but a success
        except (OSError, ValueError):
            return False

    def started_by_launchers(self, add: set[int] = frozenset(), remove: set[int] = frozenset()) -> set[int]:
        """The running SuperLinks that launchers started, after adding and removing these ids."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / self.STARTED_FILE, "a+") as record:
            fcntl.flock(record, fcntl.LOCK_EX)  # one reader-writer at a time; released on close
            record.seek(0)
            try:
                listed = set(json.loads(record.read() or "[]"))
            except json.JSONDecodeError:
                listed = set()
            running = set(_superlinks(self.home, self.port))
            started = ((listed | set(add)) - set(remove)) & running
            record.seek(0)
            record.truncate()
            record.write(json.dumps(sorted(started)))
        return started

    def __enter__(self) -> "LocalSuperLink":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / self.LOCK_FILE, "a")
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        self.before = set(_superlinks(self.home, self.port))
        self.serving_before = self.serving()
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            # Listed before the lock is given up, so the context that closes last finds it.
            started = self.started_by_launchers(add=set(_superlinks(self.home, self.port)) - self.before)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another context is open on this SuperLink: the last to close stops it
            self.stopped = sorted(started)
            for pid in self.stopped:
                _stop(pid)
            self.started_by_launchers(remove=set(self.stopped))
        finally:
            self._lock.close()

    def notice(self) -> str | None:
        """One line when a SuperLink that no launcher started was serving before and is left
        running, else None."""
        if not self.serving_before:
            return None
        theirs = sorted((self.before & set(_superlinks(self.home, self.port))) - self.started_by_launchers())
        if self.before and not theirs:
            return None  # a launcher's, stopped by the last context to close
        how = (f"`kill {' '.join(map(str, theirs))}` stops it" if theirs else
               f"it was not started for FLWR_HOME={self.home}: stop it where it was started")
        return (f"the local SuperLink on 127.0.0.1:{self.port} was running before this run and is left "
                f"running ({how})")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("app_dir")
    parser.add_argument("--run-config", action="append", default=[],
                        help="KEY=VALUE pairs (TOML values), or one TOML file; repeatable, as for flwr run")
    parser.add_argument("--federation-config", default="",
                        help=f"as for flwr run; {NUM_SUPERNODES} defaults to clients.count")
    parser.add_argument("--allow-partial", action="store_true",
                        help="exit 0 for a finished run that some client's faults left incomplete (status.json's "
                             "complete, failed_partitions, test_share)")
    args = parser.parse_args(argv)
    # A launcher stopped with SIGTERM unwinds as on Ctrl-C, so it stops the SuperLink it started.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if _main_thread() else None
    try:
        with LocalSuperLink() as superlink:
            status, folder, process = launch(args.app_dir, parse_overrides(args.run_config), args.federation_config,
                                             on_round=lambda line: print(line, flush=True))
    except (ConfigError, LaunchError, ModelNotAvailableError) as error:
        print(f"sims.launch: {error}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    notice = superlink.notice()
    if notice:
        print(f"sims.launch: {notice}", file=sys.stderr)
    sys.stdout.write(process.stdout)
    sys.stderr.write(process.stderr)
    print(f"\nrun folder: {folder}\nstatus: {status['state']}")
    if status["state"] != "finished":
        print(f"reason: {status.get('error_type', '')}: {status.get('error', '')}", file=sys.stderr)
        return 1
    if status.get("complete") is False:
        share = status.get("test_share")
        print(f"incomplete: partitions left out by faults, per round: {status.get('failed_partitions')}; test set "
              f"scored: {'unknown' if share is None else f'{share:.0%}'} (metrics.jsonl's faults say why)"
              + ("" if args.allow_partial else "; --allow-partial accepts such a run"), file=sys.stderr)
        return 0 if args.allow_partial else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
