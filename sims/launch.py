"""Run a simulation with `flwr run` and report what its run folder says.

`flwr run --stream` exits 0 even when the ServerApp failed, so this wrapper reads
the run folder's status.json and exits non-zero unless the run finished:

    python -m sims.launch sims/usl_easyvqa [--run-config 'train.rounds=5'] [--federation-config 'num-supernodes=2']
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from config import load_config


def app_config(app_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The app's run config with `overrides` applied, as the ServerApp will see it."""
    declared = tomllib.loads((Path(app_dir) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return {**declared, **(overrides or {})}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def parse_overrides(text: str) -> dict[str, Any]:
    """`key=value other="str"` as flwr reads it (TOML values; keys may contain dots)."""
    overrides = {}
    for item in text.split():
        key, _, value = item.partition("=")
        overrides[key] = tomllib.loads(f"v = {value}")["v"]
    return overrides


def installed_tools_environment() -> dict[str, str]:
    """This environment with the interpreter's scripts folder first on PATH.

    `flwr` (and the SuperLink it starts) are console scripts of the virtualenv that runs
    this module; without this, an un-activated `.venv/bin/python -m sims.launch` (as
    `make test` runs it) would not find them.
    """
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")])}


def launch(
    app_dir: str | Path, overrides: dict[str, Any] | None = None, federation_config: str = "", timeout_s: float = 3600
) -> tuple[dict[str, Any], Path, subprocess.CompletedProcess]:
    """Run the app; returns (status.json contents, run folder, the finished `flwr run` process)."""
    config = load_config(app_config(app_dir, overrides))
    folder = config.run_folder()
    status_file = folder / "status.json"
    previous = status_file.stat().st_mtime_ns if status_file.exists() else None
    command = ["flwr", "run", str(app_dir), "--stream"]
    if overrides:
        command += ["--run-config", " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())]
    if federation_config:
        command += ["--federation-config", federation_config]
    process = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, env=installed_tools_environment()
    )
    if not status_file.exists() or status_file.stat().st_mtime_ns == previous:
        status = {"state": "unknown", "error": f"the run wrote no status to {status_file}; flwr said:\n{process.stdout[-3000:]}{process.stderr[-3000:]}"}
    else:
        status = json.loads(status_file.read_text())
    return status, folder, process


def stop_local_superlink(flwr_home: str | Path) -> list[int]:
    """Stop the local SuperLink `flwr run` started for `flwr_home` (it outlives `flwr run`).

    Found by its command line, which names its log file under `flwr_home`; returns the stopped ids.
    """
    stopped = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if "flower-superlink" in args and str(flwr_home) in args:
            os.kill(int(cmdline.parent.name), signal.SIGTERM)
            stopped.append(int(cmdline.parent.name))
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("app_dir")
    parser.add_argument("--run-config", default="")
    parser.add_argument("--federation-config", default="")
    args = parser.parse_args(argv)
    status, folder, process = launch(args.app_dir, parse_overrides(args.run_config), args.federation_config)
    sys.stdout.write(process.stdout)
    sys.stderr.write(process.stderr)
    print(f"\nrun folder: {folder}\nstatus: {status['state']}")
    if status["state"] != "finished":
        print(f"reason: {status.get('error_type', '')}: {status.get('error', '')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
