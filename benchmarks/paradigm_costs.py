"""What split learning costs on Flower: round trips, bytes on the wire, wall time, memory, disk.

    python benchmarks/paradigm_costs.py [--steps 20] [--batch-size 16] [--stage base|random]
    python benchmarks/paradigm_costs.py --report

Measured side by side in one run of this script, on the mini architecture (its trained
`base` weights when built, otherwise `--stage random`: the same shapes, so the same costs):

1. Round trips per training step and bytes on the wire per sample against k × D ×
   bytes-per-element, from each run's own counters (SL, USL through `flwr run`; k: real
   tokens crossing the cut; USL moves two such tensors each way per step, SL one plus
   the answer tokens).
2. An empty round trip through `flwr run` (benchmarks/roundtrip_app: partition queries).
3. Wall time of N USL steps (steady-state round) through `flwr run`, in one process on
   the same apps (sims.inprocess's grid: the split bookkeeping without Flower's runtime)
   and on the unsplit model (the plain loop, same model and batches). Targets: in-process
   USL at most 1.15 × unsplit; `flwr run`'s extra time per step at most 1.2 × the two
   round trips a step needs.
4. Bytes the clients write to disk per training step in a warm process (target 0: one
   snapshot per turn).
5. Parameter memory of one process serving 4 virtual USL clients against one frozen base
   plus 4 × (adapters + AdamW) (target at most 1.1 ×).
6. The frozen parameter bytes each party holds at llava-1.5-7b (meta device, no weights).

Writes results/paradigm_costs.json and renders results/paradigm_costs.md from it.
Not a test: numbers depend on the machine and its load.
"""

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from analysis.provenance import model_identity, seeds_of
from clients import runtime as client_runtime
from clients.runtime import build_runtime
from config import load_config
from sims.inprocess import run_in_process
from sims.launch import LocalSuperLink, app_config, launch
from training.batches import batch_positions, decoder_inputs
from training.model import load_party_model, make_optimizer, party_parameter_bytes
from training.store import PrivateStore
from vlm.loading import build_model_on_meta, count_parameters, storage_bytes
from vlm.lora import lora_parameters
from vlm.paradigms import PARADIGMS
from vlm.profiles import get_profile
from vlm.segments import next_token_loss, run_decoder_layers
from wire import WIRE_DTYPES

from report import REPORT_HELP, add_allow_dirty, markdown_table, provenance_for, read_json, write_json, write_markdown

NAME = "paradigm_costs"
COMMAND = "python benchmarks/paradigm_costs.py"
SIMS = Path(__file__).parents[1] / "sims"
ROUNDTRIP_APP = Path(__file__).parent / "roundtrip_app"
# In-process USL rounds and unsplit runs compared (medians).
REPEATS = 3
TARGETS = {"inprocess_vs_unsplit": 1.15, "flwr_extra_vs_round_trips": 1.2, "memory_vs_shared": 1.1}
VIRTUAL_CLIENTS = 4


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def overrides_for(args, root: Path, name: str, **extra) -> dict:
    return {
        "model.stage": args.stage,
        "data.train_limit": args.train_limit,
        "data.test_limit": 10,
        "clients.count": 1,
        # Round 1 includes each client's warm-up (imports, model, data, vision features);
        # round 2 is the steady state the ratios use.
        "train.rounds": 2,
        "train.steps_per_round": args.steps,
        "train.batch_size": args.batch_size,
        "eval.every": 0,
        "output.root": str(root),
        "output.name": name,
        **extra,
    }


def unsplit_seconds(config, root: Path) -> float:
    """N steps of the whole model in one process: the plain loop, no wire, no messages."""
    runtime = build_runtime(config, 0, root / "unsplit-client")
    party = load_party_model(config)
    optimizer = make_optimizer(lora_parameters(party.model).values(), config)
    layers = party.segments[-1].stop
    started = time.perf_counter()
    for step in range(config.train.steps_per_round):
        batch = [runtime.train[p] for p in batch_positions(len(runtime.train), config.train.batch_size, step, config.model.seed)]
        inputs, _ = decoder_inputs(party.model, runtime.features, runtime.selector, batch,
                                   [b.answer_ids for b in batch], party.device)
        logits = run_decoder_layers(party.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids,
                                    0, layers, apply_head=True)
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(logits, inputs.labels).backward()
        optimizer.step()
    if party.device.type == "cuda":
        # The split run's steps end on the loss each reply carries; these end on queued kernels.
        torch.cuda.synchronize()
    return time.perf_counter() - started


class SnapshotLog:
    """Every PrivateStore.save of this process: its round and the bytes it wrote."""

    def __init__(self) -> None:
        self.saves: list[tuple[int, int]] = []
        self._original = PrivateStore.save

    def __enter__(self) -> "SnapshotLog":
        log, original = self, self._original

        def save(store: PrivateStore, round_: int, parts: dict) -> None:
            original(store, round_, parts)
            folder = store.directory / f"round-{round_:06d}"
            log.saves.append((round_, sum((folder / f"{name}.pt").stat().st_size for name in parts)))

        PrivateStore.save = save
        return self

    def __exit__(self, *exc) -> None:
        PrivateStore.save = self._original


def wire_costs(record: dict, paradigm: str, hidden: int, wire_dtype: str, batch_size: int) -> dict:
    """A round's wire from its metrics record: round trips per step, and bytes per sample each way
    against k × D × bytes-per-element (k: real tokens crossing the cut; USL moves two such tensors
    each way per step, SL one plus the answer tokens)."""
    tensors_each_way = PARADIGMS.get(paradigm).cuts
    theory = record["train_tokens"] * hidden * WIRE_DTYPES[wire_dtype].itemsize * tensors_each_way
    samples = record["steps"] * batch_size
    return {
        "round_trips_per_step": record["round_trips_per_step"],
        "round_trips": record["round_trips_train"],
        "bytes_up_per_sample": record["bytes_up"] / samples,
        "bytes_down_per_sample": record["bytes_down"] / samples,
        "k_d_bpe_per_sample_each_way": theory / samples,
        "overhead_up": record["bytes_up"] / theory - 1,
        "overhead_down": record["bytes_down"] / theory - 1,
        "tokens_per_sample": record["train_tokens"] / samples,
    }


@dataclass
class SplitAgainstUnsplit:
    """USL's steady round in one process and the same steps of the unsplit model, per repeat."""

    inprocess_rounds_s: list[float]
    unsplit_runs_s: list[float]
    steps: int
    # Every PrivateStore.save of the first in-process run: (round, bytes written).
    first_run_snapshots: list[tuple[int, int]]

    @property
    def inprocess_round_s(self) -> float:
        return statistics.median(self.inprocess_rounds_s)

    @property
    def unsplit_s(self) -> float:
        return statistics.median(self.unsplit_runs_s)


def inprocess_against_unsplit(
    run_config: Callable[[int], dict], root: Path, repeats: int = REPEATS
) -> SplitAgainstUnsplit:
    """`repeats` times: a USL run in this process (sims.inprocess: the split bookkeeping without
    Flower's runtime), then the unsplit model on the same steps. `run_config(repeat)` is that
    repeat's full run config, its second round the steady state the ratio uses. One round of each
    varies by several percent on a shared machine, so the two alternate and medians compare them."""
    inprocess_rounds, unsplit_runs, first_saves = [], [], []
    for repeat in range(repeats):
        full = run_config(repeat)
        with SnapshotLog() as snapshots:
            folder = run_in_process(full)
        _, record = read_metrics(folder.path)
        inprocess_rounds.append(record["wall_s"])
        unsplit_runs.append(unsplit_seconds(load_config(full), root))
        if repeat == 0:
            first_saves = list(snapshots.saves)
        # The last run's server segment and the unsplit model go before the next repeat builds its
        # own (at 7B two of them would not fit one GPU beside the clients' base).
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    return SplitAgainstUnsplit(inprocess_rounds, unsplit_runs, record["steps"], first_saves)


def virtual_client_memory(args, root: Path) -> dict:
    """One process, 4 USL clients after a training step each: what their parameters and AdamW hold."""
    client_runtime._BASES.clear()
    client_runtime._RUNTIMES.clear()
    overrides = overrides_for(args, root, "usl-4-clients", **{"clients.count": VIRTUAL_CLIENTS, "train.rounds": 1,
                                                             "train.steps_per_round": 1})
    run_in_process(app_config(SIMS / "usl_easyvqa", overrides))
    runtimes = list(client_runtime._RUNTIMES.values())
    model = runtimes[0].model
    own = []
    for rt in runtimes:
        for owner in rt.owned:
            own += rt.parameters(owner)
        own += [value for optimizer in rt.optimizers.values() for state in optimizer.state.values()
                for value in state.values() if torch.is_tensor(value) and value.dim() > 0]
    base = storage_bytes(p for name, p in model.named_parameters() if "lora_" not in name)
    held = storage_bytes([*model.parameters(), *own])
    whole = sum(p.numel() * p.element_size() for name, p in load_party_model(runtimes[0].config).model.named_parameters()
                if "lora_" not in name)
    return {
        "clients": len(runtimes),
        "distinct_models": len({id(rt.model) for rt in runtimes}),
        "held_bytes": held,
        "one_base_bytes": base,
        "whole_model_bytes": whole,
        "adapters_and_adamw_bytes": storage_bytes(own),
        "ratio_held_vs_one_base_plus_own": held / (base + storage_bytes(own)),
    }


def empty_round_trip(root: Path) -> dict:
    overrides = {"output.root": str(root), "output.name": "roundtrip", "clients.count": 1}
    status, _, process = launch(ROUNDTRIP_APP, overrides, "num-supernodes=1", timeout_s=600)
    if status["state"] != "finished":
        raise SystemExit(f"round trip app: {status['state']}: {status.get('error')}\n{process.stdout[-3000:]}")
    seconds = status["round_trip_s"]
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds), "count": len(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-limit", type=int, default=512)
    parser.add_argument("--stage", default="random", choices=("base", "random"))
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.report:
        print(f"wrote {render_report(read_json(NAME))}")
        return
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="paradigm-costs-"))
    # A SuperLink of our own (own home, own ports), single-threaded clients like this process.
    os.environ.update(
        FLWR_HOME=str(root / "flwr-home"), FLWR_LOCAL_CONTROL_API_PORT="39393",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="39394", OMP_NUM_THREADS="1",
    )
    # One SuperLink serves every run measured here, as for a user's repeated `flwr run`s.
    with LocalSuperLink():
        results = measure(args, root)
    write_json(NAME, results)
    print(render_report(read_json(NAME)).read_text())


def measure(args, root: Path) -> dict:
    # Every run measured here shares these (paradigm and wire dtype aside).
    declared = load_config(app_config(SIMS / "usl_easyvqa", overrides_for(args, root, "stamp")))
    stamp = provenance_for(args, seeds=seeds_of(declared.to_flat()),
                           models={declared.model.profile: model_identity(declared.model.profile, stage=args.stage)})
    results: dict = {"provenance": stamp, "steps": args.steps, "batch_size": args.batch_size,
                     "stage": args.stage, "load_average": os.getloadavg()[0], "runs": {}}

    # USL fp32 last, so the in-process and unsplit steps it is compared with run right after it.
    for paradigm, wire_dtype in (("sl", "fp32"), ("usl", "bf16"), ("usl", "fp32")):
        name = f"{paradigm}-{wire_dtype}"
        overrides = overrides_for(args, root, name, **{"wire.dtype": wire_dtype})
        started = time.perf_counter()
        status, folder, process = launch(SIMS / f"{paradigm}_easyvqa", overrides, "num-supernodes=1", timeout_s=1800)
        total = time.perf_counter() - started
        if status["state"] != "finished":
            raise SystemExit(f"{name}: run {status['state']}: {status.get('error')}\n{process.stdout[-3000:]}")
        warmup, record = read_metrics(folder)
        config = load_config(app_config(SIMS / f"{paradigm}_easyvqa", overrides))
        hidden = get_profile(config.model.profile).hidden_size
        results["runs"][name] = {
            **wire_costs(record, paradigm, hidden, wire_dtype, args.batch_size),
            "flwr_run_total_s": total,
            "flwr_round_s": record["wall_s"],
            "flwr_first_round_s": warmup["wall_s"],
            "load_average_after": os.getloadavg()[0],
        }
        print(name, json.dumps(results["runs"][name], indent=1), flush=True)

    compared = inprocess_against_unsplit(
        lambda repeat: app_config(SIMS / "usl_easyvqa", overrides_for(args, root, f"usl-inprocess-{repeat}")), root
    )
    inprocess_round, unsplit = compared.inprocess_round_s, compared.unsplit_s
    results["load_average_after_inprocess"] = os.getloadavg()[0]
    results["round_trip"] = empty_round_trip(root)
    print("round trip", json.dumps(results["round_trip"]), flush=True)
    flwr = results["runs"]["usl-fp32"]
    steps = compared.steps
    extra_per_step = (flwr["flwr_round_s"] - inprocess_round) / steps
    round_trip = results["round_trip"]["median_s"]
    results["wall"] = {
        "usl_flwr_round_s": flwr["flwr_round_s"],
        "usl_inprocess_round_s": inprocess_round,
        "unsplit_one_process_s": unsplit,
        "usl_inprocess_rounds_s": compared.inprocess_rounds_s,
        "unsplit_runs_s": compared.unsplit_runs_s,
        "ratio_inprocess_vs_unsplit": inprocess_round / unsplit,
        "flwr_extra_s_per_step": extra_per_step,
        "ratio_flwr_extra_vs_two_round_trips": extra_per_step / (2 * round_trip),
        "ratio_flwr_round_vs_unsplit": flwr["flwr_round_s"] / unsplit,
        "startup_and_teardown_s": flwr["flwr_run_total_s"] - flwr["flwr_round_s"] - flwr["flwr_first_round_s"],
        "first_round_warmup_s": flwr["flwr_first_round_s"] - flwr["flwr_round_s"],
    }
    steady = [written for round_, written in compared.first_run_snapshots if round_ == 2]
    results["disk"] = {
        "snapshots_in_steady_round": len(steady),
        "turns_in_steady_round": 1,
        "snapshot_bytes": steady[-1] if steady else 0,
        # Everything written besides the turn's one snapshot, spread over its steps.
        "bytes_per_step_besides_the_turn_snapshot": (sum(steady) - (steady[-1] if steady else 0)) / steps,
    }
    print("wall", json.dumps(results["wall"], indent=1), "disk", json.dumps(results["disk"]), flush=True)

    results["memory"] = virtual_client_memory(args, root)
    print("memory", json.dumps(results["memory"]), flush=True)
    profile = get_profile("llava-1.5-7b")
    results["party_bytes_7b"] = party_parameter_bytes(profile, count_parameters(build_model_on_meta(profile)))
    return results


def render_report(results: dict, folder: Path | None = None) -> Path:
    wall, memory, disk, trip = results["wall"], results["memory"], results["disk"], results["round_trip"]
    settings = (f"{results['steps']} steps of {results['batch_size']} samples per round, mini shapes "
                f"(`--stage {results['stage']}`), steady-state round. 1-minute load average: "
                f"{results['load_average']:.2f} at the start, {results['runs']['usl-fp32']['load_average_after']:.2f} "
                f"after the USL `flwr run`, {results['load_average_after_inprocess']:.2f} after the in-process and "
                "unsplit steps it is compared with (other work on the machine slows the two alike only when it is "
                "steady).")
    targets = markdown_table(
        ["measure", "measured", "target"],
        [
            ["in-process USL round / unsplit steps (same model, same batches; medians of 3, alternated)",
             f"{wall['ratio_inprocess_vs_unsplit']:.2f}× ({wall['usl_inprocess_round_s']:.2f} s / "
             f"{wall['unsplit_one_process_s']:.2f} s)", f"≤ {TARGETS['inprocess_vs_unsplit']}×"],
            ["`flwr run` extra time per step / two empty round trips",
             f"{wall['ratio_flwr_extra_vs_two_round_trips']:.2f}× ({wall['flwr_extra_s_per_step'] * 1000:.0f} ms / "
             f"2 × {trip['median_s'] * 1000:.0f} ms)", f"≤ {TARGETS['flwr_extra_vs_round_trips']}×"],
            [f"parameter memory, {memory['clients']} virtual clients / (one base + their adapters and AdamW)",
             f"{memory['ratio_held_vs_one_base_plus_own']:.3f}× ({memory['held_bytes'] / 2**20:.1f} MiB)",
             f"≤ {TARGETS['memory_vs_shared']}×"],
            ["bytes written to disk per training step in a warm process",
             f"{disk['bytes_per_step_besides_the_turn_snapshot']:.0f} B ({disk['snapshots_in_steady_round']} snapshot "
             f"of {disk['snapshot_bytes'] / 2**20:.2f} MiB per turn)", "0 (one snapshot per turn)"],
        ],
    )
    runs = markdown_table(
        ["run", "round trips / step", "bytes up / sample", "bytes down / sample", "k·D·bpe / sample",
         "overhead up", "overhead down", "round (s)", "first round (s)"],
        [[name, r["round_trips_per_step"], r["bytes_up_per_sample"], r["bytes_down_per_sample"],
          r["k_d_bpe_per_sample_each_way"], f"{r['overhead_up']:.2%}", f"{r['overhead_down']:.2%}",
          r["flwr_round_s"], r["flwr_first_round_s"]] for name, r in results["runs"].items()],
    )
    parties = markdown_table(
        ["party", "fp16 / bf16 (GB)", "fp32 (GB)"],
        [[party, f"{held['16-bit'] / 1e9:.2f}", f"{held['fp32'] / 1e9:.2f}"]
         for party, held in results["party_bytes_7b"].items()],
    )
    body = "\n\n".join([
        settings, "## Targets", targets,
        f"Empty round trip through `flwr run`: median {trip['median_s'] * 1000:.0f} ms "
        f"(min {trip['min_s'] * 1000:.0f}, max {trip['max_s'] * 1000:.0f}, {trip['count']} queries). "
        f"Four whole models would hold {4 * memory['whole_model_bytes'] / 2**20:.1f} MiB; the clients' shared base "
        f"is {memory['one_base_bytes'] / 2**20:.1f} MiB of the whole {memory['whole_model_bytes'] / 2**20:.1f} MiB.",
        "## Through `flwr run`", runs,
        "## Frozen parameters each party holds at llava-1.5-7b (default cuts, LoRA excluded)", parties,
    ])
    return write_markdown(NAME, "What split learning costs on Flower", body, results.get("provenance"),
                          command=COMMAND, **({} if folder is None else {"folder": folder}))


if __name__ == "__main__":
    main()
