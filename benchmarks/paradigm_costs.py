"""What split learning costs on Flower: round trips, bytes on the wire, wall time.

    python benchmarks/paradigm_costs.py [--steps 20] [--batch-size 16] [--stage base|random] [--out FILE]

Measured in one run of this script, on the mini architecture (its trained `base`
weights when built, otherwise `--stage random`: the same shapes, so the same costs):

1. Round trips per training step, from each run's own counters (SL, USL through `flwr run`).
2. Bytes on the wire per sample against k × D × bytes-per-element, per direction and
   wire dtype (k: real tokens crossing the cut; USL moves two such tensors each way
   per step, SL one plus the answer tokens).
3. Wall time of N USL steps through `flwr run` (steady-state round) against the same steps in one process:
   (a) the same apps on sims.inprocess's grid (the split bookkeeping without Flower's
   runtime) and (b) the unsplit model's plain training loop — and where the time goes.

Not a test: numbers depend on the machine and its load.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from sims.inprocess import run_in_process
from sims.launch import app_config, launch, stop_local_superlink
from config import load_config
from training.batches import batch_positions, decoder_inputs
from training.model import load_party_model, make_optimizer
from clients.runtime import build_runtime
from vlm.lora import lora_parameters
from vlm.profiles import get_profile
from vlm.segments import next_token_loss, run_decoder_layers
from wire import WIRE_DTYPES

SIMS = Path(__file__).parents[1] / "sims"


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
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-limit", type=int, default=512)
    parser.add_argument("--stage", default="random", choices=("base", "random"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="paradigm-costs-"))
    # A SuperLink of our own (own home, own ports), single-threaded clients like this process.
    os.environ.update(
        FLWR_HOME=str(root / "flwr-home"), FLWR_LOCAL_CONTROL_API_PORT="39393",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="39394", OMP_NUM_THREADS="1",
    )
    try:
        measure(args, root)
    finally:
        stop_local_superlink(root / "flwr-home")


def measure(args, root: Path) -> None:
    results: dict = {"steps": args.steps, "batch_size": args.batch_size, "stage": args.stage, "runs": {}}

    for paradigm, wire_dtype in (("sl", "fp32"), ("usl", "fp32"), ("usl", "bf16")):
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
        per_element = WIRE_DTYPES[wire_dtype].itemsize
        # Tensors of k × D per step and direction: USL activation at CA + gradient at CB up,
        # activation at CB + gradient at CA down; SL activation up, gradient down.
        tensors_each_way = 2 if paradigm == "usl" else 1
        theory = record["train_tokens"] * hidden * per_element * tensors_each_way
        samples = record["steps"] * args.batch_size
        results["runs"][name] = {
            "round_trips_per_step": record["round_trips_per_step"],
            "round_trips": record["round_trips_train"],
            "bytes_up_per_sample": record["bytes_up"] / samples,
            "bytes_down_per_sample": record["bytes_down"] / samples,
            "k_d_bpe_per_sample_each_way": theory / samples,
            "overhead_up": record["bytes_up"] / theory - 1,
            "overhead_down": record["bytes_down"] / theory - 1,
            "tokens_per_sample": record["train_tokens"] / samples,
            "flwr_run_total_s": total,
            "flwr_round_s": record["wall_s"],
            "flwr_first_round_s": warmup["wall_s"],
        }
        print(name, json.dumps(results["runs"][name], indent=1), flush=True)

    usl = overrides_for(args, root, "usl-inprocess", paradigm="usl")
    full = app_config(SIMS / "usl_easyvqa", usl)
    started = time.perf_counter()
    folder = run_in_process(full)
    inprocess_total = time.perf_counter() - started
    _, record = read_metrics(folder.path)
    unsplit = unsplit_seconds(load_config(full), root)
    flwr = results["runs"]["usl-fp32"]
    results["wall"] = {
        "usl_flwr_run_total_s": flwr["flwr_run_total_s"],
        "usl_flwr_round_s": flwr["flwr_round_s"],
        "usl_inprocess_total_s": inprocess_total,
        "usl_inprocess_round_s": record["wall_s"],
        "unsplit_one_process_s": unsplit,
        "ratio_flwr_round_vs_unsplit": flwr["flwr_round_s"] / unsplit,
        "ratio_flwr_round_vs_inprocess_round": flwr["flwr_round_s"] / record["wall_s"],
        # Where the time goes: start-up before the first round, Flower's per-round-trip wait,
        # and the split's own bookkeeping (head re-run for its backward, private state on disk).
        "startup_and_teardown_s": flwr["flwr_run_total_s"] - flwr["flwr_round_s"] - flwr["flwr_first_round_s"],
        "first_round_warmup_s": flwr["flwr_first_round_s"] - flwr["flwr_round_s"],
        "runtime_s_per_round_trip": (flwr["flwr_round_s"] - record["wall_s"]) / flwr["round_trips"],
        "split_bookkeeping_s": record["wall_s"] - unsplit,
    }
    print("wall", json.dumps(results["wall"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
