"""A deployment round trip against Flower's floor, and USL steps per minute in deployment,
with the warm per-node worker (clients.worker) and without it.

    python benchmarks/deployment_roundtrip.py [--usl-rounds 2] [--usl-steps 2] [--load "..."]
    python benchmarks/deployment_roundtrip.py --report

Measured side by side in one run of this script, on one loopback deployment of the tested
recipe (sims.loopback: TLS, SuperNode authentication, the nginx gateway; 2 SuperNodes), tiny
profile:

1. The round trip of one partition query (benchmarks/roundtrip_app's server, 20 after 3
   warm-up) answered by Flower's floor (floor_client.py: a ClientApp importing only flwr), by
   this system's ClientApp with `clients.warm_worker=false` (each message's `flwr-clientapp`
   imports the client code) and with the warm worker. Target: warm at most 1.5 × the floor.
2. Where the difference goes: a fresh interpreter importing `flwr.clientapp` against
   `clients.app` (the handlers: torch, transformers, the model code), and building one tiny USL
   client (model, shard, vision features), which every training message paid without a worker.
3. A short USL run (2 clients) through the deployment, each way: wall time per round from its
   metrics.jsonl and training steps per minute (steps of all clients / round wall time).

Writes results/deployment_roundtrip.json and renders results/deployment_roundtrip.md from it.
Not a test: numbers depend on the machine and its load (give it with --load).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from analysis.provenance import seeds_of
from clients.runtime import build_runtime
from config import load_config
from sims.deploy import CONNECTION
from sims.launch import app_config, toml_value
from sims.loopback import LoopbackFederation

from report import (
    REPORT_HELP, RESULTS, add_allow_dirty, markdown_table, provenance_for, read_json, write_json, write_markdown,
)

NAME = "deployment_roundtrip"
COMMAND = "python benchmarks/deployment_roundtrip.py"
SIMS = Path(__file__).parents[1] / "sims"
ROUNDTRIP_APP = Path(__file__).parent / "roundtrip_app"
TARGET = 1.5
IMPORT_REPEATS = 3


def floor_app(folder: Path) -> Path:
    """The round-trip app with the floor's ClientApp (a copy: a FAB names one ClientApp)."""
    app = folder / "roundtrip_floor"
    shutil.copytree(ROUNDTRIP_APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = app / "pyproject.toml"
    text = pyproject.read_text()
    if 'clientapp = "clients.worker:app"' not in text:
        raise SystemExit(f"{ROUNDTRIP_APP}/pyproject.toml no longer names clients.worker:app as its ClientApp")
    pyproject.write_text(text.replace('clientapp = "clients.worker:app"', 'clientapp = "floor_client:app"'))
    return app


def run_config(values: dict) -> str:
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def flwr_run(federation: LoopbackFederation, app: Path, values: dict, timeout: float) -> dict:
    """`flwr run` of `app` on the deployment; the run's status.json (its folder is output.root/output.name)."""
    started = time.perf_counter()
    run = federation.flwr("run", str(app), CONNECTION, "--stream", "--run-config", run_config(values), timeout=timeout)
    folder = Path(values["output.root"]) / values["output.name"]
    status_file = folder / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {"state": "no status.json"}
    if status.get("state") != "finished":
        raise SystemExit(f"{app.name} ({values['output.name']}): {status.get('state')}: {status.get('error')}\n"
                         f"{run.stdout[-3000:]}{run.stderr[-2000:]}")
    status["wall_s"] = time.perf_counter() - started
    return status


def round_trips(federation: LoopbackFederation, app: Path, root: Path, name: str, warm: bool) -> dict:
    values = {"output.root": str(root), "output.name": name, "model.profile": "tiny", "clients.count": 2,
              "clients.warm_worker": warm}
    seconds = flwr_run(federation, app, values, timeout=1800)["round_trip_s"]
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds), "count": len(seconds)}


def usl_run(federation: LoopbackFederation, root: Path, name: str, warm: bool, args) -> dict:
    values = {"output.root": str(root), "output.name": name, "model.profile": "tiny", "clients.count": 2,
              "data.train_limit": 32, "data.test_limit": 4, "train.rounds": args.usl_rounds,
              "train.steps_per_round": args.usl_steps, "train.batch_size": 4, "eval.every": 0,
              "clients.warm_worker": warm}
    status = flwr_run(federation, SIMS / "usl_easyvqa", values, timeout=3600)
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    walls = [record["wall_s"] for record in records]
    steps = 2 * args.usl_steps
    return {"round_wall_s": walls, "run_wall_s": status["wall_s"], "steps_per_round": steps,
            "steps_per_min_first": 60 * steps / walls[0], "steps_per_min_later": 60 * steps / statistics.median(walls[1:])
            if len(walls) > 1 else None}


def import_seconds(module: str) -> float:
    """Median wall time of a fresh interpreter importing `module` (what each flwr-clientapp pays)."""
    times = []
    for _ in range(IMPORT_REPEATS):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def client_build_seconds(root: Path) -> float:
    """Building one tiny USL client, as a fresh process does before its first message."""
    config = load_config(app_config(SIMS / "usl_easyvqa", {
        "output.root": str(root), "output.name": "build", "model.profile": "tiny", "data.train_limit": 32,
        "data.test_limit": 4}))
    started = time.perf_counter()
    build_runtime(config, 0, root / "build-state")
    return time.perf_counter() - started


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="qpriv-deploy-bench-") as tmp:
        root = Path(tmp)
        # Every run here is tiny with the apps' declared seeds.
        declared = load_config(app_config(SIMS / "usl_easyvqa", {"output.root": str(root), "output.name": "stamp",
                                                                 "model.profile": "tiny"}))
        stamp = provenance_for(args, seeds=seeds_of(declared.to_flat()), models=[declared.model.profile])
        load_before = Path("/proc/loadavg").read_text().split()[:3]
        breakdown = {"import_flwr_clientapp_s": import_seconds("flwr.clientapp"),
                     "import_clients_app_s": import_seconds("clients.app"),
                     "build_tiny_usl_client_s": client_build_seconds(root)}
        with LoopbackFederation(root / "deploy", nodes=2) as federation:
            trips = {"floor": round_trips(federation, floor_app(root), root, "floor", warm=False),
                     "per_message_process": round_trips(federation, ROUNDTRIP_APP, root, "cold", warm=False),
                     "warm_worker": round_trips(federation, ROUNDTRIP_APP, root, "warm", warm=True)}
            usl = {"per_message_process": usl_run(federation, root, "usl-cold", False, args),
                   "warm_worker": usl_run(federation, root, "usl-warm", True, args)}
        load_after = Path("/proc/loadavg").read_text().split()[:3]
    return {"provenance": stamp, "load": args.load, "loadavg_before": load_before, "loadavg_after": load_after,
            "round_trip": trips, "breakdown": breakdown, "usl": usl,
            "ratio_warm_vs_floor": trips["warm_worker"]["median_s"] / trips["floor"]["median_s"],
            "ratio_per_message_vs_floor": trips["per_message_process"]["median_s"] / trips["floor"]["median_s"],
            "target_warm_vs_floor": TARGET}


def render_report(data: dict, folder: Path = RESULTS) -> Path:
    trips, usl, parts = data["round_trip"], data["usl"], data["breakdown"]
    names = {"floor": "Flower's floor (ClientApp importing only flwr)",
             "per_message_process": "this system, clients.warm_worker=false (a process per message)",
             "warm_worker": "this system, warm worker (clients.warm_worker=true)"}
    body = [
        f"Load: {data['load'] or 'not given'}; load average before {' '.join(data['loadavg_before'])}, "
        f"after {' '.join(data['loadavg_after'])}.",
        "",
        "## One round trip (partition query), deployment on loopback (TLS, authenticated nodes, gateway)",
        "",
        markdown_table(["ClientApp", "median s", "min s", "max s", "n"],
                       [[names[key], value["median_s"], value["min_s"], value["max_s"], value["count"]]
                        for key, value in trips.items()]),
        "",
        f"Warm worker / floor: **{data['ratio_warm_vs_floor']:.2f}×** (target ≤ {data['target_warm_vs_floor']}×); "
        f"a process per message / floor: {data['ratio_per_message_vs_floor']:.2f}×.",
        "",
        "## Where a process per message spends it (fresh interpreter, same machine)",
        "",
        markdown_table(["step", "seconds"], [
            ["import flwr.clientapp (the floor's import)", parts["import_flwr_clientapp_s"]],
            ["import clients.app (torch, transformers, the model code)", parts["import_clients_app_s"]],
            ["build one tiny USL client (model, shard, vision features)", parts["build_tiny_usl_client_s"]],
        ]),
        "",
        "Every message without the worker pays the import; every training message also builds the client and "
        "reloads its private state. The worker pays both once per run and node.",
        "",
        "## USL in deployment (tiny, 2 clients)",
        "",
        markdown_table(["ClientApp", "round wall s", "steps/round", "steps/min, round 1", "steps/min, later rounds"],
                       [[names[key], ", ".join(f"{wall:.1f}" for wall in value["round_wall_s"]), value["steps_per_round"],
                         value["steps_per_min_first"], value["steps_per_min_later"]] for key, value in usl.items()]),
        "",
        "Round 1 with the worker includes starting it (imports and client build, once per node).",
    ]
    return write_markdown(NAME, "Deployment round trip: Flower's floor, a process per message, the warm worker",
                          "\n".join(body), data.get("provenance"), command=COMMAND,
                          folder=folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--usl-rounds", type=int, default=2, help="USL rounds per run (the first starts the worker)")
    parser.add_argument("--usl-steps", type=int, default=2, help="steps per client per USL round")
    parser.add_argument("--load", default="", help="what else ran on the machine (kept in the JSON)")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.usl_rounds < 1 or args.usl_steps < 1:
        parser.error(f"--usl-rounds {args.usl_rounds} and --usl-steps {args.usl_steps}: each at least 1")
    if not args.report:
        if shutil.which("nginx") is None:
            parser.error("nginx is not installed (the deployment's gateway): scripts/setup.sh installs it")
        write_json(NAME, measure(args))
    print(render_report(read_json(NAME)))


if __name__ == "__main__":
    main()
