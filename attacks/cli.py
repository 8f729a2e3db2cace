"""`python -m attacks` (or `qpriv-attack`): list the attacks, or replay one against a recorded run.

    python -m attacks list
    python -m attacks run ~/qpriv-runs/usl-run fora -o decoder_steps=3000 -o decoder_width=128
    python -m attacks run ~/qpriv-runs/fl-run idlg --node-partition 4711=0 --node-partition 815=1

Option values are JSON where they parse as JSON (numbers, booleans, lists), strings
otherwise. The result (metrics, details; reconstructions as safetensors) goes to
`<run>/attacks/` unless --out says otherwise, and its metrics are printed. A missing run
folder or recording and an option the attack does not allow are refused in one line (exit 2)
before anything is fitted.
"""

import argparse
import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from attacks.base import AttackOptionError, attack_class, available_attacks, checked_options
from attacks.recording import MissingObservationError
from attacks.replay import recording_at, replay


def parse_option(text: str) -> tuple[str, Any]:
    """One attack option from the command line: KEY=VALUE, the value read as JSON where it parses."""
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"options are key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _node_partition(text: str) -> tuple[int, int]:
    node, separator, partition = text.partition("=")
    if not separator or not node.isdigit() or not partition.isdigit():
        raise argparse.ArgumentTypeError(f"--node-partition takes NODE_ID=PARTITION_ID, got {text!r}")
    return int(node), int(partition)


def _check_run(run_folder: str, attack: str, options: dict[str, Any], round_: int | None) -> None:
    """What the replay needs, checked before it fits anything: the options, the folder, its recording
    (and the round asked for)."""
    checked_options(attack, attack_class(attack).Options, options)
    folder = Path(run_folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"no run folder at {folder}")
    recording_at(folder, attack, round_)


def _describe(name: str) -> str:
    attack = attack_class(name)
    settings = ", ".join(
        f"{f.name}={f.default!r}" for f in fields(attack.Options) if f.default is not MISSING
    )
    summary = (sys.modules[attack.__module__].__doc__ or "").splitlines()[0]
    return f"{name} ({attack.threat_model}): {summary}\n    options: {settings}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attacks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the registered attacks and their options")
    run = commands.add_parser("run", help="replay an attack against a recorded run folder")
    run.add_argument("run_folder", help="a run folder holding recording/ (Recorder.factory)")
    run.add_argument("attack", choices=available_attacks())
    run.add_argument("-o", "--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                     help="an attack option (see `list`); repeatable")
    run.add_argument("--aux-limit", type=int,
                     help="auxiliary (public) rows the attacker trains on (default: the run's threat.aux_limit)")
    run.add_argument("--node-partition", action="append", type=_node_partition, default=[],
                     metavar="NODE=PARTITION", help="which client partition a node id held (runs under flwr run)")
    run.add_argument("--partition", type=int, default=0, help="the client whose model a query attack (MIA) targets")
    run.add_argument("--round", type=int, default=None, dest="round_",
                     help="replay on that round's transfers only (a run that stored several: threat.record_rounds); "
                          "saved under <run>/attacks/round-<r>/")
    run.add_argument("--out", help="where the result goes (default: <run>/attacks/)")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(_describe(name) for name in available_attacks()))
        return 0
    try:
        _check_run(args.run_folder, args.attack, dict(args.option), args.round_)
    except (AttackOptionError, FileNotFoundError, MissingObservationError, ValueError) as error:
        print(f"python -m attacks: {error}", file=sys.stderr)
        return 2
    result = replay(
        args.run_folder, args.attack, options=dict(args.option), aux_limit=args.aux_limit,
        node_partitions=dict(args.node_partition) or None, partition=args.partition, output=args.out,
        round_=args.round_,
    )
    print(json.dumps({"attack": result.attack, "metrics": result.metrics}, indent=2, sort_keys=True))
    return 0
