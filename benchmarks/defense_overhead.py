"""What each defense at the cut costs the client, per 1k tokens, as a ratio to the undefended front.

    python benchmarks/defense_overhead.py [--repeats 5] [--batch-size 16] [--paradigm usl]
    python benchmarks/defense_overhead.py --report

Measured side by side in one run on the mini model (its trained `base` weights; `--stage
random` gives the same shapes, so the same costs, without building mini): one client's training
front (selector, projector, decoder layers up to the first cut, the defenses) on the
same batches, the defenses taken in turn within each repeat so the machine's load falls
on all of them alike; the median over repeats. Seed 001 measured on an RTX 4090 (Qwen3-0.6B):
noise 1.03 s, sparsification 1.00 s, PriPert 4.37 s per 1k tokens (PriPert 4.2× noise),
and 3.32 / 4.37 / 5.35 s for 1 / 2 / 3 path steps. The gradient defenses at CB and
NoPeek's correlation are timed the same way (NoPeek: the front plus its loss term).

Writes results/defense_overhead.json and renders results/defense_overhead.md from it.
Not a test: numbers depend on the machine and its load (say which when you quote them).
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from analysis.provenance import model_identity, seeds_of
from clients.runtime import build_runtime
from clients.sl import SLClient
from clients.usl import USLClient
from config import load_config
from privacy import DefenseChain, defense_class, options_from

from report import (
    REPORT_HELP, RESULTS, add_allow_dirty, markdown_table, provenance_for, read_json, write_json, write_markdown,
)

NAME = "defense_overhead"
COMMAND = "python benchmarks/defense_overhead.py"
# (label, defense, options): what is timed, in this order within each repeat.
SETTINGS: list[tuple[str, str | None, dict[str, Any]]] = [
    ("none", None, {}),
    ("noise 1e-2", "noise", {"variance": 1e-2}),
    ("sparsify 0.5", "sparsify", {"ratio": 0.5}),
    ("sparsify-token 0.5", "sparsify", {"ratio": 0.5, "level": "token"}),
    ("pripert-l0 0.5, 1 step", "pripert", {"sparsity": 0.5, "steps": 1}),
    ("pripert-l0 0.5, 2 steps", "pripert", {"sparsity": 0.5, "steps": 2}),
    ("pripert-l0 0.5, 3 steps", "pripert", {"sparsity": 0.5, "steps": 3}),
    ("pripert-l0 0.5, 2 steps, 8 iterations", "pripert", {"sparsity": 0.5, "steps": 2, "iterations": 8}),
    ("pripert-l2 0.5", "pripert", {"variant": "l2", "budget": 0.5}),
    ("nopeek 0.5", "nopeek", {"weight": 0.5}),
]
PAPER = {"noise": 1.0303, "sparsification": 0.9984, "pripert": 4.3703, "steps": {1: 3.3228, 2: 4.3703, 3: 5.3510}}


def chain(defense: str | None, options: dict[str, Any]) -> DefenseChain:
    if defense is None:
        return DefenseChain()
    return DefenseChain([defense_class(defense)(options_from(defense_class(defense), options))])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    stage = args.stage
    with tempfile.TemporaryDirectory() as root:
        config = load_config({
            "paradigm": args.paradigm, "model.profile": "mini", "model.stage": stage, "data.train_limit": 256,
            "data.test_limit": 16, "clients.count": 1, "train.batch_size": args.batch_size,
            "output.root": root, "output.name": "overhead",
        })
        stamp = provenance_for(args, seeds=seeds_of(config.to_flat()),
                               models={"mini": model_identity("mini", stage=stage)})
        runtime = build_runtime(config, 0, os.path.join(root, "client"))
        runtime.sync_private_state()
        client = {"usl": USLClient, "sl": SLClient}[args.paradigm](runtime)
        seconds: dict[str, list[float]] = {label: [] for label, _, _ in SETTINGS}
        tokens = []
        for repeat in range(args.repeats + 1):
            runtime.step = repeat
            # A new batch's first pass pays for its inputs (features, pruning inputs): untimed.
            runtime.defenses = DefenseChain()
            client.train_front(1)
            for label, defense, options in SETTINGS:
                runtime.defenses = chain(defense, options)
                started = time.perf_counter()
                _, front = client.train_front(1)
                if front.defense_loss is not None:
                    front.defense_loss.backward(retain_graph=True)
                elapsed = time.perf_counter() - started
                if repeat:  # the first pass warms caches and allocators
                    seconds[label].append(elapsed)
                    tokens.append(front.rows.shape[0])
        per_k = {label: 1000 * statistics.median(values) / statistics.median(tokens) for label, values in seconds.items()}
    return {
        "stamp": stamp,
        "settings": {"paradigm": args.paradigm, "stage": stage, "batch_size": args.batch_size,
                     "repeats": args.repeats, "tokens_per_batch": statistics.median(tokens),
                     "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()},
        "seconds_per_1k_tokens": per_k,
        "ratio_to_none": {label: value / per_k["none"] for label, value in per_k.items()},
    }


def render_report(data: dict[str, Any], folder: Path = RESULTS) -> Path:
    s = data["settings"]
    rows = [[label, value, data["ratio_to_none"][label]] for label, value in data["seconds_per_1k_tokens"].items()]
    noise = data["seconds_per_1k_tokens"]["noise 1e-2"]
    steps = [data["seconds_per_1k_tokens"][f"pripert-l0 0.5, {n} step{'s' if n > 1 else ''}"] for n in (1, 2, 3)]
    body = "\n".join([
        f"One {s['paradigm'].upper()} client's training front on mini ({s['stage']} weights), batches of "
        f"{s['batch_size']} (~{s['tokens_per_batch']:.0f} tokens), median of {s['repeats']} repeats taken in turn; "
        f"{s['torch_threads']} torch threads, load average {', '.join(f'{v:.1f}' for v in s['load_average'])} "
        "when it started.",
        "",
        markdown_table(["defense", "s / 1k tokens", "× undefended front"], rows),
        "",
        f"PriPert (2 steps) / noise: {data['seconds_per_1k_tokens']['pripert-l0 0.5, 2 steps'] / noise:.1f}× here; "
        f"seed 001: {PAPER['pripert'] / PAPER['noise']:.1f}× (RTX 4090, Qwen3-0.6B, 4.37 vs 1.03 s per 1k tokens, "
        "where noise's time is the whole client front).",
        f"Path steps 1 / 2 / 3: {' / '.join(f'{v:.3g}' for v in steps)} s per 1k tokens here "
        f"(× {steps[1] / steps[0]:.2f} and × {steps[2] / steps[0]:.2f} of one step); seed 001: 3.32 / 4.37 / 5.35 s "
        f"(× {PAPER['steps'][2] / PAPER['steps'][1]:.2f} and × {PAPER['steps'][3] / PAPER['steps'][1]:.2f}).",
    ])
    return write_markdown(NAME, "Defense overhead on the client", body, data["stamp"], command=COMMAND, folder=folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--paradigm", choices=("usl", "sl"), default="usl")
    parser.add_argument("--stage", choices=("base", "random"), default="base")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: at least 1")
    if not args.report:
        write_json(NAME, measure(args))
    print(render_report(read_json(NAME)).read_text())


if __name__ == "__main__":
    main()
