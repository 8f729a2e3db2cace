"""Paper scale on one GPU: the 7B USL run's step, per party, with nothing downloaded.

    python benchmarks/gpu_scale.py [--rounds 3] [--steps 4] [--batch-size 8] [--client-gpus 0.5]
    python benchmarks/gpu_scale.py --report
    python benchmarks/gpu_scale.py --profile tiny --device cpu --out /tmp/gpu-scale   # the script itself, on a CPU

On one CUDA GPU, sized to take at most eight minutes of wall time at the defaults (the report
says how long it took), three phases, each recorded even when another fails:

1. The paper's sim, sims/usl_vqarad (USL at CA=8/CB=24, LoRA r=32, bf16 weights and wire), with
   `model.stage="random"`: LLaVA-1.5-7B's shapes with seeded random weights drawn on the GPU, each
   party keeping only its segments (training.model). 2 clients and the server share the GPU
   through `flwr run` (Ray, `client-resources-num-gpus` a fraction), for a few rounds of a few
   steps, DTP on (`pruning.policy="dtp"` with an untrained module of the 7B pruning profile over
   random CLIP-T and DINOv2 towers of its shapes, `untrained_dtp`: it scores the 576 patches and
   keeps as many as its ρ̂ says), the server passive (a recording for phase 2), the last round also
   evaluating.
   The sim's components run with benchmarks/party_probe.py's probes (`probed_app`), which time
   each party's own methods in its own process. Measured, over the rounds after the first:
   - per step and party (`party_accounting`): the server's step, body forward, body backward with
     its AdamW step, and its wait at each cut (a message out until the reply is in: at CB the
     client's tail, at CA its head's backward and next forward), less the client's handling of
     that message: Flower's delivery both ways; the client's head and tail forward, head and tail
     backward with their AdamW steps, the turn's snapshot, and its wait after each cut's tensor
     left (the server's body and the delivery);
   - per process (`process_memory`): the model build's time, the GPU memory peak while building
     and held after it, and the peak after it (torch's allocator);
   - the wire (`wire_per_step`, paradigm_costs.wire_costs on the run's metrics.jsonl): bytes each
     way per step against k·D·b (k: the tokens crossing a cut, D = 4096, b = 2 bytes in bf16; USL
     moves two such tensors each way per step), and round trips per step.
2. One FORA replay (attacks.replay) on phase 1's recorded activations at CA, at a few steps of
   its substitute and inverse network: its wall time and GPU peak. On random weights its PSNR
   only shows that it ran.
3. The in-process USL round against the unsplit model on the same steps, on the same GPU
   (paradigm_costs.inprocess_against_unsplit, the ratio the mini reports in
   results/paradigm_costs.md), one client.

Data: VQA-RAD is not bundled (nothing is downloaded), and a random-weight model has no tokenizer: every party
reads the bundled easy-VQA with the word tokenizer over the run's questions and answers (as the
random-weight runs do, training.data), its 64×64 images resized to 336×336 by CLIP's preprocessing,
so the 576 patches, the decoder's width and the cuts are the paper's; the vocabulary is 64 words
(the LM head 64 rows instead of 32,064: about 2% of a step's arithmetic).

Without a CUDA GPU (`--device cuda`, the default) it stops at once with one line saying what it
needs. `--profile tiny --device cpu` runs every phase on the CPU: the check that the script works
up to the device. Writes <out>/gpu_scale.json after each phase and renders <out>/gpu_scale.md
from it (default out: results/), stamped with the GPU, its driver, torch and CUDA versions, the
commit.
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from analysis.provenance import model_identity, seeds_of
from training import protocol
from vlm.profiles import get_profile, profile_names

from report import (
    REPORT_HELP, RESULTS, add_allow_dirty, markdown_table, provenance_for, read_json, write_json, write_markdown,
)

if TYPE_CHECKING:
    from config import SimConfig

NAME = "gpu_scale"
COMMAND = "python benchmarks/gpu_scale.py"
SIM = Path(__file__).parents[1] / "sims" / "usl_vqarad"
PROBE = Path(__file__).with_name("party_probe.py")
PAPER_PROFILE = "llava-1.5-7b"
DEVICES = ("cuda", "cpu")
# Round 1 builds every party's model and caches; the rounds after it are measured.
FIRST_STEADY_ROUND = 2
TRAIN_MESSAGES = (protocol.SPLIT_BEGIN, protocol.USL_TAIL, protocol.USL_HEAD)
# The cut whose tensor a client's reply to each training message carries: what it then waits on.
REPLY_CUT = {protocol.SPLIT_BEGIN: "ca", protocol.USL_HEAD: "ca", protocol.USL_TAIL: "cb"}
TEST_ROWS_PER_CLIENT = 2
ANSWER_TOKENS = 4
# The attacker's public rows (threat.aux_limit) and FORA at a few steps: that it runs at 7B, and its cost.
AUX_ROWS = 8
FORA_OPTIONS = {"substitute_steps": 3, "decoder_steps": 10, "batch_size": 4, "progress": False}
FLWR_RUN_TIMEOUT_S = 420
# A SuperLink of this script's own (own FLWR_HOME and ports, apart from paradigm_costs' 39393-4).
PORTS = {"FLWR_LOCAL_CONTROL_API_PORT": "39397", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39398"}
ROUND_KEYS = ("round", "steps", "train_loss", "wall_s", "round_trips_train", "round_trips_per_step", "bytes_up",
              "bytes_down", "train_tokens", "kept_tokens_mean", "test_accuracy", "faults")
GIB = 2**30


# -- arguments and the device ---------------------------------------------------------------

def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=PAPER_PROFILE, help="model profile (tiny: the script on a CPU)")
    parser.add_argument("--device", default="cuda", choices=DEVICES)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per client and round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--client-gpus", type=float, default=0.5,
                        help="client-resources-num-gpus: each Ray actor's share of the GPU (the server's process "
                             "shares it outside Ray)")
    parser.add_argument("--repeats", type=int, default=2, help="in-process USL and unsplit runs, alternated")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of gpu_scale.json and .md")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    return parser.parse_args(argv)


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line (None: nothing)."""
    if args.profile not in profile_names():
        return f"--profile {args.profile}: one of {', '.join(profile_names())}"
    if args.device == "cpu" and args.profile == PAPER_PROFILE:
        return (f"--device cpu with --profile {PAPER_PROFILE}: a 7B step on the CPU takes minutes; the CPU checks "
                "the script with a small profile (--profile tiny)")
    if args.rounds < 3:
        return (f"--rounds {args.rounds}: at least 3 (round 1 builds and warms up, the rounds after it are measured, "
                "the last also evaluates)")
    for option in ("clients", "steps", "batch_size", "repeats"):
        if getattr(args, option) < 1:
            return f"--{option.replace('_', '-')} {getattr(args, option)}: at least 1"
    if args.device == "cuda" and not 0 < args.client_gpus <= 1:
        return (f"--client-gpus {args.client_gpus}: in (0, 1]; Ray shows no GPU at all to an actor that asks for "
                "none")
    return None


def missing_device(device: str) -> str | None:
    """What this machine lacks for `device`, in one line (None: nothing)."""
    if device != "cuda" or torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"needs a CUDA GPU and a CUDA build of torch; torch {torch.__version__} here is a CPU build "
                "(docs/gpu.md installs one into .venv; --profile tiny --device cpu checks the script without a GPU)")
    return (f"needs a CUDA GPU; torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
            "(--profile tiny --device cpu checks the script without a GPU)")


def device_stamp(device: str) -> dict[str, Any]:
    """What the numbers were measured on: the GPU, its memory and driver, torch and its CUDA."""
    stamp: dict[str, Any] = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        stamp |= {"gpu": torch.cuda.get_device_name(0),
                  "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory, "driver": nvidia_driver()}
    return stamp


def nvidia_driver() -> str | None:
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return listed.splitlines()[0].strip() if listed.strip() else None


# -- the run's settings ----------------------------------------------------------------------

def probed_app(folder: Path) -> Path:
    """sims/usl_vqarad with its components wrapped by the probes: its pyproject.toml pointed at
    party_probe, and party_probe.py beside it (a FAB holds the files of its folder)."""
    text = (SIM / "pyproject.toml").read_text()
    for component, probed in (('serverapp = "strategies.app:app"', 'serverapp = "party_probe:server_app"'),
                              ('clientapp = "clients.worker:app"', 'clientapp = "party_probe:client_app"')):
        if component not in text:
            raise RuntimeError(f"{SIM}/pyproject.toml no longer says {component}; point probed_app at its components")
        text = text.replace(component, probed)
    # Flower's app folders take no underscores in `flwr build`.
    app = folder / "usl-vqarad-probed"
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(text)
    shutil.copy(PROBE, app / PROBE.name)
    return app


def run_overrides(args: argparse.Namespace, root: Path, artifacts: Path, name: str) -> dict[str, Any]:
    """The sim's run config changed only where this check needs it (see the module's docstring)."""
    overrides = {
        "model.profile": args.profile,
        "model.stage": "random",
        "model.device": args.device,
        "data.dataset": "easyvqa",
        "data.source": "",
        "data.train_limit": 2 * args.clients * args.batch_size,
        "data.test_limit": TEST_ROWS_PER_CLIENT * args.clients,
        "clients.count": args.clients,
        "train.rounds": args.rounds,
        "train.steps_per_round": args.steps,
        "train.batch_size": args.batch_size,
        "eval.every": args.rounds,
        "eval.batch_size": TEST_ROWS_PER_CLIENT,
        "eval.max_new_tokens": ANSWER_TOKENS,
        "pruning.policy": "dtp",
        "pruning.artifacts": str(artifacts),
        "threat.model": "passive",
        # The first step's activation at CA and the rows the server sent back: what FORA reads, stored
        # within round 1, so the measured rounds write no recording.
        "threat.max_samples": 2 * args.batch_size,
        "threat.aux_limit": AUX_ROWS,
        "output.root": str(root / "runs"),
        "output.name": name,
    }
    if args.profile != PAPER_PROFILE:
        # The sim's cuts and LoRA rank are the 7B model's; a small profile takes its own.
        overrides |= {"split.cut_a": 0, "split.cut_b": 0, "model.lora_rank": get_profile(args.profile).lora_rank}
    return overrides


def federation_config(args: argparse.Namespace) -> str:
    gpus = args.client_gpus if args.device == "cuda" else 0
    return f"num-supernodes={args.clients} client-resources-num-cpus=2 client-resources-num-gpus={gpus}"


def untrained_dtp(config: "SimConfig", folder: Path) -> Path:
    """A DTP artefact for `config`'s model and data whose module is seeded and untrained, over the
    random towers every random-weight client builds (the word tokenizer over the run's samples:
    training.data's rule), so the dtp policy loads it as it would a prepared one."""
    from pruning import build_qpriv_vl, build_random_encoders, get_pruning_profile, save_dtp
    from training.data import RunData
    from vlm.mini.tokenizer import build_sample_tokenizer

    profile = get_pruning_profile(config.model.profile)
    encoders = build_random_encoders(profile, build_sample_tokenizer(RunData.build(config).samples))
    module = build_qpriv_vl(profile, seed=config.pruning.seed, alpha=config.pruning.alpha, beta=config.pruning.beta)
    save_dtp(folder, module, encoders)
    return folder


# -- reading the probes ----------------------------------------------------------------------

def read_probes(run_folder: Path) -> list[dict[str, Any]]:
    from party_probe import PROBE_FOLDER

    return [json.loads(line) for path in sorted((Path(run_folder) / PROBE_FOLDER).glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _measured(spans: Sequence[dict], role: str, first_round: int) -> list[dict]:
    return [s for s in spans if s["role"] == role and (s.get("round") or 0) >= first_round]


def _total(spans: Sequence[dict], name: str, *, parent: str | None = None, message: str | None = None,
           own: bool = False) -> float:
    """Seconds of the calls named `name` (inside `parent`, serving `message`); `own`: less their timed calls."""
    return sum(s["seconds"] - (s["children_s"] if own else 0.0) for s in spans
               if s["name"] == name and (parent is None or s["parent"] == parent)
               and (message is None or s.get("message") == message))


def client_waits(spans: Sequence[dict]) -> dict[str, float]:
    """Seconds a client waited after each cut's tensor left, until its next training message came:
    the gaps between consecutive training messages of one partition and round (their start times
    are wall-clock times, comparable across processes)."""
    turns: dict[tuple, list[dict]] = defaultdict(list)
    for span in spans:
        if span["name"] == "message" and span.get("message") in TRAIN_MESSAGES:
            # By partition, not process: two Ray actors may serve one client's turn.
            turns[span["partition"], span["round"]].append(span)
    waits = {"ca": 0.0, "cb": 0.0}
    for messages in turns.values():
        messages.sort(key=lambda span: span["start"])
        for sent, following in zip(messages, messages[1:]):
            waits[REPLY_CUT[sent["message"]]] += following["start"] - (sent["start"] + sent["seconds"])
    return waits


def party_accounting(spans: Sequence[dict], first_round: int = FIRST_STEADY_ROUND) -> dict[str, Any]:
    """Each party's seconds per training step over the rounds from `first_round` (evaluation left
    out): the timed parts of a step, and what the step spent besides them (`other_s`)."""
    server = _measured(spans, "server", first_round)
    steps = sum(1 for s in server if s["name"] == "step")
    if not steps:
        raise ValueError(f"the probes recorded no server step from round {first_round} on: did the run reach it?")
    server_parts = {
        "body_forward_s": _total(server, "body", parent="step"),
        "body_backward_s": _total(server, "first_cut_gradient", parent="step"),
        "wait_at_cb_s": _total(server, "wait", parent="step", message=protocol.USL_TAIL),
        "wait_at_ca_s": _total(server, "wait", parent="step", message=protocol.USL_HEAD),
    }
    step_s = _total(server, "step")
    client = [s for s in _measured(spans, "client", first_round) if s.get("message") in TRAIN_MESSAGES]
    client_parts = {
        "head_forward_s": _total(client, "cut_activation"),
        "head_backward_s": _total(client, "front_backward", own=True),
        "tail_forward_s": _total(client, "tail", parent="tail_step"),
        "tail_backward_s": _total(client, "tail_step", own=True),
        "snapshot_s": _total(client, "snapshot"),
    }
    handlers_s = _total(client, "message")
    waits = client_waits(client)
    delivery = {
        "delivery_at_cb_s": server_parts["wait_at_cb_s"] - _total(client, "message", message=protocol.USL_TAIL),
        "delivery_at_ca_s": server_parts["wait_at_ca_s"] - _total(client, "message", message=protocol.USL_HEAD),
    }
    return {
        "steps": steps,
        "rounds_from": first_round,
        "server": {"step_s": step_s / steps, **{k: v / steps for k, v in server_parts.items()},
                   "other_s": (step_s - sum(server_parts.values())) / steps,
                   **{k: v / steps for k, v in delivery.items()}},
        "client": {"handlers_s": handlers_s / steps, **{k: v / steps for k, v in client_parts.items()},
                   "other_s": (handlers_s - sum(client_parts.values())) / steps,
                   "wait_after_ca_s": waits["ca"] / steps, "wait_after_cb_s": waits["cb"] / steps},
    }


def process_memory(spans: Sequence[dict]) -> list[dict[str, Any]]:
    """Per process: its role, the partitions it served, its model build's time and memory (the peak
    while building, what it held after), and its peak after the build (the steps', and a client's
    set-up besides its model: vision features, DTP inputs)."""
    processes: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for span in spans:
        processes[span["role"], span["pid"]].append(span)
    rows = []
    for (role, pid), own in sorted(processes.items()):
        builds = [s for s in own if s["name"] == "build"]
        built_at = max((s["start"] + s["seconds"] for s in builds), default=0.0)
        after = [s for s in own if s["name"] != "build" and s["start"] + s["seconds"] > built_at]
        rows.append({
            "role": role,
            "pid": pid,
            "partitions": sorted({s["partition"] for s in own if s.get("partition") is not None}),
            "memory": own[-1]["memory"],
            "build_s": sum(s["seconds"] for s in builds),
            "build_peak_bytes": max((s["peak_bytes"] for s in builds), default=None),
            "held_after_build_bytes": builds[-1]["held_bytes"] if builds else None,
            "peak_after_build_bytes": max((s["peak_bytes"] for s in after), default=None),
        })
    return rows


def wire_per_step(records: Sequence[dict], hidden: int, batch_size: int, first_round: int = FIRST_STEADY_ROUND) -> dict:
    """The wire over the measured rounds that did not evaluate (their bytes would count the
    evaluation's), per step: paradigm_costs.wire_costs' per-sample figures times the batch."""
    from paradigm_costs import wire_costs

    measured = [r for r in records if r["round"] >= first_round and "test_accuracy" not in r]
    if not measured:
        raise ValueError(f"no training-only round from round {first_round} on to count the wire of")
    summed = {key: sum(r[key] for r in measured) for key in ("train_tokens", "steps", "bytes_up", "bytes_down",
                                                             "round_trips_train")}
    summed["round_trips_per_step"] = summed["round_trips_train"] / summed["steps"]
    costs = wire_costs(summed, "usl", hidden, "bf16", batch_size)
    return {
        "rounds": [r["round"] for r in measured],
        "round_trips_per_step": costs["round_trips_per_step"],
        "bytes_up_per_step": costs["bytes_up_per_sample"] * batch_size,
        "bytes_down_per_step": costs["bytes_down_per_sample"] * batch_size,
        "k_d_b_per_step_each_way": costs["k_d_bpe_per_sample_each_way"] * batch_size,
        "overhead_up": costs["overhead_up"],
        "overhead_down": costs["overhead_down"],
        "tokens_per_sample": costs["tokens_per_sample"],
    }


# -- the phases ------------------------------------------------------------------------------
# Their imports are theirs: without a GPU the script stops before Flower, Ray and the model code load.

def _reset_peak() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None


def usl_through_flwr(args: argparse.Namespace, root: Path, artifacts: Path) -> dict[str, Any]:
    from sims.launch import launch

    from paradigm_costs import read_metrics

    app = probed_app(root)
    started = time.perf_counter()
    status, folder, process = launch(app, run_overrides(args, root, artifacts, "usl-flwr"), federation_config(args),
                                     timeout_s=FLWR_RUN_TIMEOUT_S)
    total = time.perf_counter() - started
    if status["state"] != "finished":
        raise RuntimeError(f"the run {status['state']}: {status.get('error')}\nflwr run said:\n"
                           f"{process.stdout[-2000:]}{process.stderr[-2000:]}")
    records = read_metrics(folder)
    faults = [fault for record in records for fault in record.get("faults", [])]
    if faults:
        raise RuntimeError(f"{len(faults)} client fault(s), the first in {faults[0]['phase']}: {faults[0]['reason']}")
    spans = read_probes(folder)
    return {
        "run_folder": str(folder),
        "flwr_run_s": total,
        "rounds": [{key: record.get(key) for key in ROUND_KEYS} for record in records],
        "per_step": party_accounting(spans),
        "processes": process_memory(spans),
        "wire": wire_per_step(records, get_profile(args.profile).hidden_size, args.batch_size),
    }


def fora_replay(run_folder: str) -> dict[str, Any]:
    from attacks.replay import replay

    _reset_peak()
    started = time.perf_counter()
    result = replay(run_folder, "fora", options=FORA_OPTIONS, aux_limit=AUX_ROWS)
    return {"replay_s": time.perf_counter() - started, "peak_bytes": _peak(), "options": FORA_OPTIONS,
            "aux_rows": AUX_ROWS, "observed_samples": result.details["observed_samples"],
            "mean_kept_tokens": result.details["mean_kept_tokens"], "metrics": result.metrics}


def split_against_unsplit(args: argparse.Namespace, root: Path, artifacts: Path) -> dict[str, Any]:
    from sims.launch import app_config

    from paradigm_costs import TARGETS, inprocess_against_unsplit

    def run_config(repeat: int) -> dict[str, Any]:
        overrides = run_overrides(args, root, artifacts, f"inprocess-{repeat}")
        # One client, the mini's comparison: its second round against the same steps unsplit.
        overrides |= {"clients.count": 1, "train.rounds": 2, "eval.every": 0, "threat.model": "none"}
        return app_config(SIM, overrides)

    _reset_peak()
    compared = inprocess_against_unsplit(run_config, root, repeats=args.repeats)
    return {
        "steps": compared.steps,
        "inprocess_round_s": compared.inprocess_round_s,
        "unsplit_s": compared.unsplit_s,
        "inprocess_rounds_s": compared.inprocess_rounds_s,
        "unsplit_runs_s": compared.unsplit_runs_s,
        "ratio": compared.inprocess_round_s / compared.unsplit_s,
        "mini_target": TARGETS["inprocess_vs_unsplit"],
        "peak_bytes": _peak(),
    }


def run_phase(results: dict[str, Any], name: str, phase: Callable[[], dict[str, Any]], out: Path) -> bool:
    """One phase's numbers, or the error that stopped it, into results and onto disk at once: a
    phase that fails leaves the others' numbers, and the report says what broke."""
    started = time.perf_counter()
    try:
        outcome = {"ok": True, **phase()}
    except Exception as error:  # noqa: BLE001 - every phase is reported, and the next one runs
        outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"[:3000],
                   "traceback": traceback.format_exc()[-6000:]}
    outcome["wall_s"] = time.perf_counter() - started
    # What the phase held goes before the next one builds its models (two 7B copies would not fit).
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    results["phases"][name] = outcome
    write_json(NAME, results, out)
    print(f"{NAME}: {name}: {'ok' if outcome['ok'] else outcome['error']} ({outcome['wall_s']:.0f} s)", flush=True)
    return outcome["ok"]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from config import load_config
    from sims.launch import app_config, stop_local_superlink

    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="gpu-scale-"))
    os.environ.update(FLWR_HOME=str(root / "flwr-home"), **PORTS)
    artifacts = root / "dtp"
    # The run's settings before its DTP artefact exists (the schema refuses a dtp policy without one).
    config = load_config(app_config(SIM, {**run_overrides(args, root, artifacts, "usl"), "pruning.policy": "off"}))
    profile = get_profile(args.profile)
    stamp = provenance_for(args, seeds=seeds_of(config.to_flat()),
                           models={args.profile: model_identity(args.profile, stage=config.model.stage)})
    results: dict[str, Any] = {
        "provenance": stamp,
        "device": device_stamp(args.device),
        "settings": {"sim": "sims/usl_vqarad", "profile": args.profile, "dtype": config.model.dtype,
                     "wire": config.wire.dtype, "cuts": list(config.cuts), "lora_rank": config.model.lora_rank,
                     "patches": profile.num_patches, "hidden": profile.hidden_size, "dataset": config.data.dataset,
                     "clients": args.clients, "rounds": args.rounds, "steps": args.steps,
                     "batch_size": args.batch_size, "client_gpus": args.client_gpus if args.device == "cuda" else 0,
                     "repeats": args.repeats},
        "phases": {},
    }
    try:
        if run_phase(results, "dtp_artifact", lambda: {"folder": str(untrained_dtp(config, artifacts))}, args.out):
            if run_phase(results, "flwr_run", lambda: usl_through_flwr(args, root, artifacts), args.out):
                run_phase(results, "fora", lambda: fora_replay(results["phases"]["flwr_run"]["run_folder"]), args.out)
            run_phase(results, "inprocess", lambda: split_against_unsplit(args, root, artifacts), args.out)
    finally:
        stop_local_superlink(root / "flwr-home")
    results["wall_s"] = time.perf_counter() - started
    write_json(NAME, results, args.out)
    return results


# -- the report ------------------------------------------------------------------------------

def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{1000 * seconds:.0f}"


def _gib(value: int | None) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


PHASES = {
    "dtp_artifact": "untrained DTP module of the pruning profile's shapes",
    "flwr_run": "USL through `flwr run` (Ray), the parties probed",
    "fora": "FORA replay on the recorded activations at CA",
    "inprocess": "in-process USL round against the unsplit steps",
}
SERVER_ROWS = (
    ("step_s", "step, end to end"),
    ("body_forward_s", "body forward (layers CA–CB)"),
    ("body_backward_s", "body backward and its AdamW step"),
    ("wait_at_cb_s", "wait at CB: rows at CB out, their gradient in (the client's tail)"),
    ("wait_at_ca_s", "wait at CA: gradient at CA out, the next activation in (the client's head)"),
    ("other_s", "the rest: wire codec and checks, the recorder"),
    ("delivery_at_cb_s", "of the wait at CB, Flower's delivery both ways (less the client's handler)"),
    ("delivery_at_ca_s", "of the wait at CA, Flower's delivery both ways (less the client's handler)"),
)
CLIENT_ROWS = (
    ("handlers_s", "its message handlers, end to end"),
    ("head_forward_s", "head forward: DTP, projector, layers 0–CA"),
    ("head_backward_s", "head backward and its AdamW step"),
    ("tail_forward_s", "tail forward: layers CB–L and the LM head"),
    ("tail_backward_s", "loss, tail backward and its AdamW step"),
    ("snapshot_s", "the turn's snapshot of its adapters and AdamW (once a turn)"),
    ("other_s", "the rest of its handlers: wire codec and checks"),
    ("wait_after_ca_s", "wait after the activation at CA left (the server's body forward, transport)"),
    ("wait_after_cb_s", "wait after the gradient at CB left (the server's body backward, transport)"),
)


def _header(results: dict[str, Any]) -> str:
    device, settings = results["device"], results["settings"]
    if device["device"] == "cuda":
        machine = (f"**{device['gpu']}** ({_gib(device['gpu_memory_bytes'])} GiB, driver "
                   f"{device['driver'] or 'unknown'}), torch {device['torch']} with CUDA {device['cuda']}")
    else:
        machine = f"the **CPU** (torch {device['torch']}): the script's check, not a measurement of the paper's scale"
    cut_a, cut_b = settings["cuts"]
    return (
        f"Measured on {machine}. Model `{settings['profile']}` with seeded random weights (nothing downloaded), "
        f"{settings['dtype']} weights and a {settings['wire']} wire; `{settings['sim']}`: USL at CA={cut_a}, "
        f"CB={cut_b}, LoRA r={settings['lora_rank']}; DTP scoring {settings['patches']} patches (an untrained module "
        f"over random towers of the pruning profile's shapes). {settings['clients']} clients and the server share "
        f"the device through `flwr run` (Ray, `client-resources-num-gpus={settings['client_gpus']}`), "
        f"{settings['rounds']} rounds of {settings['steps']} steps of {settings['batch_size']} samples per client, "
        f"the last round also evaluating; data: {settings['dataset']} at the model's image size (module docstring). "
        + (f"The whole check took {results['wall_s']:.0f} s." if "wall_s" in results else
           "The check did not finish: the phases below are those it recorded.")
    )


def _phases_table(results: dict[str, Any]) -> str:
    rows = []
    for name, phase in results["phases"].items():
        outcome = "ok" if phase["ok"] else "failed: " + phase["error"].splitlines()[0][:300].replace("|", "\\|")
        rows.append([PHASES.get(name, name), f"{phase['wall_s']:.0f}", outcome])
    return markdown_table(["phase", "wall (s)", "outcome"], rows)


def _flwr_sections(run: dict[str, Any]) -> list[str]:
    per_step = run["per_step"]
    steps = (f"Mean per training step over {per_step['steps']} steps (all clients) of rounds "
             f"{per_step['rounds_from']}–{run['rounds'][-1]['round']}; evaluation left out. Each timed call begins "
             "and ends with `torch.cuda.synchronize()` (benchmarks/party_probe.py).")
    party_rows = [["server", label, _ms(per_step["server"][key])] for key, label in SERVER_ROWS]
    party_rows += [["client", label, _ms(per_step["client"][key])] for key, label in CLIENT_ROWS]
    memory = markdown_table(
        ["party", "process", "partitions", "model build (s)", "peak while building (GiB)", "held after (GiB)",
         "peak after building (GiB)"],
        [[p["role"], p["pid"], ", ".join(map(str, p["partitions"])) or "—", f"{p['build_s']:.1f}",
          _gib(p["build_peak_bytes"]), _gib(p["held_after_build_bytes"]), _gib(p["peak_after_build_bytes"])]
         for p in run["processes"]],
    )
    memory_kind = {p["memory"] for p in run["processes"]}
    wire = run["wire"]
    wire_table = markdown_table(
        ["round trips / step", "bytes up / step", "bytes down / step", "k·D·b / step, each way", "overhead up",
         "overhead down", "k / sample"],
        [[wire["round_trips_per_step"], f"{wire['bytes_up_per_step']:,.0f}", f"{wire['bytes_down_per_step']:,.0f}",
          f"{wire['k_d_b_per_step_each_way']:,.0f}", f"{wire['overhead_up']:.3%}", f"{wire['overhead_down']:.3%}",
          f"{wire['tokens_per_sample']:.1f}"]],
    )
    rounds = markdown_table(
        ["round", "steps", "wall (s)", "train loss", "kept visual tokens (mean)", "test accuracy"],
        [[r["round"], r["steps"], r["wall_s"], r["train_loss"], r["kept_tokens_mean"], r["test_accuracy"]]
         for r in run["rounds"]],
    )
    return [
        "## Per step, each party", steps, markdown_table(["party", "part of the step", "ms / step"], party_rows),
        "## Memory per process",
        ("torch's CUDA allocator. Its peak is reset once the model is built, so the last column is what came "
         "after: the steps, and a client's vision features and DTP inputs."
         if memory_kind == {"cuda"} else "Peak resident set size of each process (the CPU run)."),
        memory,
        f"## The wire (round{'s' if len(wire['rounds']) > 1 else ''} {', '.join(map(str, wire['rounds']))})",
        ("USL moves two tensors each way per step (up: the activation at CA and the gradient at CB; down: the rows "
         "at CB and the gradient at CA), so each way carries 2·k·D·b; k: the tokens crossing a cut, D the hidden "
         "size, b the wire's bytes per element. A turn of T steps takes 2T + 1 round trips (one opens it)."),
        wire_table,
        "## Rounds", rounds,
    ]


def _fora_section(fora: dict[str, Any]) -> list[str]:
    metrics = ", ".join(f"{name} {value:.3g}" for name, value in sorted(fora["metrics"].items())) or "none scored"
    options = ", ".join(f"{name}={value}" for name, value in fora["options"].items())
    return ["## FORA replay",
            f"{fora['observed_samples']} recorded samples at CA ({fora['mean_kept_tokens']:.0f} visual rows each, on "
            f"average), {fora['aux_rows']} public rows; options {options}. {fora['replay_s']:.0f} s, GPU peak "
            f"{_gib(fora['peak_bytes'])} GiB. Scores (random weights: they show only that it ran): {metrics}."]


def _inprocess_section(compared: dict[str, Any]) -> list[str]:
    runs = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(compared["inprocess_rounds_s"], compared["unsplit_runs_s"]))
    return ["## In-process USL against the unsplit model",
            f"One client's steady round of {compared['steps']} USL steps in one process against the same steps of "
            f"the unsplit model: **{compared['ratio']:.2f}×** ({compared['inprocess_round_s']:.2f} s / "
            f"{compared['unsplit_s']:.2f} s, medians of alternated runs: {runs} s); the mini's target is at most "
            f"{compared['mini_target']}× (results/paradigm_costs.md). GPU peak {_gib(compared['peak_bytes'])} GiB."]


def render_report(results: dict[str, Any], folder: Path = RESULTS) -> Path:
    phases = results["phases"]
    sections = [_header(results), "## Phases", _phases_table(results)]
    if phases.get("flwr_run", {}).get("ok"):
        sections += _flwr_sections(phases["flwr_run"])
    if phases.get("fora", {}).get("ok"):
        sections += _fora_section(phases["fora"])
    if phases.get("inprocess", {}).get("ok"):
        sections += _inprocess_section(phases["inprocess"])
    return write_markdown(NAME, "Paper scale on one GPU: the 7B USL step per party", "\n\n".join(sections),
                          results.get("provenance"), command=COMMAND, folder=folder)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.report:
        print(f"wrote {render_report(read_json(NAME, args.out), args.out)}")
        return 0
    problem = missing_device(args.device) or check_arguments(args)
    if problem:
        print(f"{NAME}: {problem}", file=sys.stderr)
        return 2
    results = measure(args)
    print(f"wrote {render_report(results, args.out)}")
    return 0 if all(phase["ok"] for phase in results["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
