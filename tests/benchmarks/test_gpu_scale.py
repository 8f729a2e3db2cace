"""benchmarks/gpu_scale.py up to the device: without a GPU it stops in one line; its arguments are
checked; the probed sim is the sim's own config; the per-party accounting adds up, on hand-made
probe records and on a probed in-process USL run of the tiny profile (random weights, DTP on: its
numbers mean nothing, its counts and sums do); the report renders from its JSON alone."""

import json
import sys
import tomllib
from pathlib import Path

import pytest

from config import load_config
from sims.inprocess import InProcessGrid
from sims.launch import app_config, preflight
from strategies.app import run
from strategies.split import SplitStrategy, USLStrategy
from training import protocol

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_scale as G  # noqa: E402
import party_probe as P  # noqa: E402
from paradigm_costs import read_metrics  # noqa: E402

TINY_ARGS = ["--profile", "tiny", "--device", "cpu", "--rounds", "3", "--steps", "2", "--batch-size", "2"]


def tiny_args(*extra: str):
    return G.parse_arguments([*TINY_ARGS, *extra])


@pytest.mark.parametrize(("cuda", "says"), [(None, "torch 2.13.0+cpu here is a CPU build"), ("12.8", "sees none")])
def test_without_a_gpu_it_stops_at_once_with_one_line(monkeypatch, capsys, cuda, says):
    monkeypatch.setattr(G.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(G.torch.version, "cuda", cuda)
    monkeypatch.setattr(G.torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(G, "measure", lambda args: pytest.fail("measured without a GPU"))
    assert G.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("gpu_scale: needs a CUDA GPU") and says in captured.err


@pytest.mark.parametrize(("argv", "problem"), [
    (["--device", "cpu"], "--device cpu with --profile llava-1.5-7b"),
    (["--profile", "gpt2"], "--profile gpt2: one of"),
    (["--rounds", "2"], "--rounds 2: at least 3"),
    (["--steps", "0"], "--steps 0: at least 1"),
    (["--batch-size", "0"], "--batch-size 0: at least 1"),
    (["--clients", "0"], "--clients 0: at least 1"),
    (["--client-gpus", "0"], "--client-gpus 0.0: in (0, 1]"),
    (["--client-gpus", "1.5"], "--client-gpus 1.5: in (0, 1]"),
])
def test_arguments_that_cannot_run_are_refused_naming_the_option(argv, problem):
    assert G.check_arguments(G.parse_arguments(argv)).startswith(problem)


@pytest.mark.parametrize("argv", [[], TINY_ARGS, [*TINY_ARGS, "--client-gpus", "0"]])
def test_the_defaults_and_the_cpu_check_pass(argv):
    assert G.check_arguments(G.parse_arguments(argv)) is None


def test_a_refused_argument_is_one_line_on_a_gpu_machine(monkeypatch, capsys):
    monkeypatch.setattr(G.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(G, "measure", lambda args: pytest.fail("measured with a refused argument"))
    assert G.main(["--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gpu_scale: --rounds 1")


def test_the_probed_app_is_the_paper_sim_with_its_components_probed(tmp_path):
    app = G.probed_app(tmp_path)
    probed, sim = (tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
                   for folder in (app, G.SIM))
    assert probed["config"] == sim["config"]
    assert probed["components"] == {"serverapp": "party_probe:server_app", "clientapp": "party_probe:client_app"}
    assert (app / "party_probe.py").read_bytes() == G.PROBE.read_bytes()
    assert "_" not in app.name


def test_the_launcher_accepts_the_checks_settings_with_its_dtp_artifact(tmp_path):
    args = tiny_args()
    artifacts = tmp_path / "dtp"
    G.untrained_dtp(load_config(app_config(G.SIM, {**G.run_overrides(args, tmp_path, artifacts, "x"),
                                                   "pruning.policy": "off"})), artifacts)
    config = preflight(G.probed_app(tmp_path), G.run_overrides(args, tmp_path, artifacts, "usl"),
                       G.federation_config(args))
    assert (config.model.profile, config.model.stage, config.model.dtype, config.wire.dtype) == \
        ("tiny", "random", "bf16", "bf16")
    assert (config.pruning.policy, config.threat.model, config.clients.count) == ("dtp", "passive", 2)
    assert G.federation_config(args).endswith("client-resources-num-gpus=0")
    assert "client-resources-num-gpus=0.5" in G.federation_config(G.parse_arguments([]))


def span(role, name, start, seconds, *, parent=None, children_s=0.0, pid=1, **context):
    return {"role": role, "pid": pid, "name": name, "parent": parent, "start": start, "seconds": seconds,
            "children_s": children_s, "peak_bytes": 0, "held_bytes": 0, "memory": "cuda", **context}


def test_the_accounting_of_handmade_records():
    """One measured step (round 2) beside a warm-up step (round 1) and an evaluation, which it leaves out."""
    server = [
        span("server", "step", 0.0, 10.0, round=2, children_s=8.9),
        span("server", "body", 0.0, 1.0, parent="step", round=2),
        span("server", "wait", 1.0, 3.4, parent="step", round=2, message=protocol.USL_TAIL),
        span("server", "first_cut_gradient", 4.0, 2.0, parent="step", round=2),
        span("server", "wait", 6.0, 2.5, parent="step", round=2, message=protocol.USL_HEAD),
        span("server", "step", -20.0, 9.0, round=1),
        span("server", "body", 11.0, 5.0, parent="eval_step", round=2),
    ]
    turn = dict(role="client", pid=2, partition=0, round=2)
    client = [
        span(name="message", start=0.0, seconds=1.0, message=protocol.SPLIT_BEGIN, children_s=0.8, **turn),
        span(name="cut_activation", start=0.1, seconds=0.8, parent="message", message=protocol.SPLIT_BEGIN, **turn),
        span(name="message", start=2.0, seconds=3.0, message=protocol.USL_TAIL, children_s=2.9, **turn),
        span(name="tail_step", start=2.0, seconds=2.9, parent="message", message=protocol.USL_TAIL, children_s=1.0,
             **turn),
        span(name="tail", start=2.0, seconds=1.0, parent="tail_step", message=protocol.USL_TAIL, **turn),
        span(name="message", start=6.5, seconds=2.0, message=protocol.USL_HEAD, children_s=2.0, **turn),
        span(name="front_backward", start=6.5, seconds=2.0, parent="message", message=protocol.USL_HEAD,
             children_s=0.7, **turn),
        span(name="snapshot", start=7.0, seconds=0.2, parent="front_backward", message=protocol.USL_HEAD, **turn),
        span(name="cut_activation", start=7.5, seconds=0.5, parent="front_backward", message=protocol.USL_HEAD,
             **turn),
        span(name="message", start=20.0, seconds=4.0, message=protocol.USL_EVAL_TAIL, **turn),
    ]
    accounting = G.party_accounting(server + client)
    assert accounting["steps"] == 1
    assert accounting["server"] == pytest.approx({
        "step_s": 10.0, "body_forward_s": 1.0, "body_backward_s": 2.0, "wait_at_cb_s": 3.4, "wait_at_ca_s": 2.5,
        "other_s": 1.1, "delivery_at_cb_s": 0.4, "delivery_at_ca_s": 0.5,
    })
    assert accounting["client"] == pytest.approx({
        "handlers_s": 6.0, "head_forward_s": 1.3, "head_backward_s": 1.3, "tail_forward_s": 1.0,
        "tail_backward_s": 1.9, "snapshot_s": 0.2, "other_s": 0.3, "wait_after_ca_s": 1.0, "wait_after_cb_s": 1.5,
    })


def test_the_accounting_needs_a_measured_step():
    with pytest.raises(ValueError, match="no server step from round 2 on"):
        G.party_accounting([span("server", "step", 0.0, 1.0, round=1)])


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    """A USL run of the check's own settings at tiny on the CPU, in this process, both parties probed."""
    root = tmp_path_factory.mktemp("gpu-scale")
    args = tiny_args()
    artifacts = root / "dtp"
    G.untrained_dtp(load_config(app_config(G.SIM, {**G.run_overrides(args, root, artifacts, "usl"),
                                                   "pruning.policy": "off"})), artifacts)
    run_config = app_config(G.SIM, G.run_overrides(args, root, artifacts, "usl"))
    config = load_config(run_config)
    folder = P.probe_folder(config)
    server, client = P.Probe(P.SERVER, folder), P.Probe(P.CLIENT, folder)
    with P.installed(P.server_patches(server) + P.client_patches(client)):
        grid = InProcessGrid(P.ProbedClientApp(P.sim_client_app, client), run_config, config.clients.count)
        run_folder = run(grid, config)
    return args, run_folder.path


def test_the_probes_come_off_with_the_run(probed_run):
    assert "first_cut_gradient" not in vars(USLStrategy)
    assert USLStrategy.first_cut_gradient is SplitStrategy.first_cut_gradient
    assert not hasattr(USLStrategy.body, "__wrapped__")


def test_a_probed_run_accounts_every_measured_step_of_each_party(probed_run):
    args, folder = probed_run
    spans = G.read_probes(folder)
    accounting = G.party_accounting(spans)
    # Rounds 2 and 3 of 2 clients × 2 steps.
    assert accounting["steps"] == (args.rounds - 1) * args.clients * args.steps
    for party in ("server", "client"):
        assert all(value >= -1e-9 for value in accounting[party].values()), accounting[party]
    server = accounting["server"]
    assert server["step_s"] >= server["body_forward_s"] + server["body_backward_s"] + server["wait_at_ca_s"]
    assert min(accounting["client"][key] for key in ("head_forward_s", "head_backward_s", "tail_forward_s",
                                                      "tail_backward_s", "snapshot_s")) > 0
    trains = [s for s in spans if s["name"] == "message" and s["message"] in G.TRAIN_MESSAGES and s["round"] >= 2]
    # Each step is a tail and a head message; each turn opens with one more.
    assert len(trains) == 2 * accounting["steps"] + (args.rounds - 1) * args.clients


def test_a_probed_run_records_each_process_and_its_build(probed_run):
    args, folder = probed_run
    processes = {row["role"]: row for row in G.process_memory(G.read_probes(folder))}
    assert set(processes) == {"server", "client"}
    assert processes["client"]["partitions"] == list(range(args.clients))
    for row in processes.values():
        assert row["build_s"] > 0 and row["memory"] == "rss"
        assert row["peak_after_build_bytes"] >= row["held_after_build_bytes"] > 0


def test_a_probed_run_counts_the_wire_per_step_against_k_d_b(probed_run):
    args, folder = probed_run
    records = read_metrics(folder)
    hidden = G.get_profile("tiny").hidden_size
    wire = G.wire_per_step(records, hidden, args.batch_size)
    # Round 3 evaluates, so round 2 alone is the wire's.
    assert wire["rounds"] == [2]
    assert wire["round_trips_per_step"] == 2 + 1 / args.steps
    (measured,) = [r for r in records if r["round"] == 2]
    assert wire["k_d_b_per_step_each_way"] == 2 * measured["train_tokens"] * hidden * 2 / measured["steps"]
    assert wire["bytes_up_per_step"] > wire["k_d_b_per_step_each_way"]
    # DTP pruned: fewer visual rows than the 16 patches, plus the prompt's text.
    assert all(r["kept_tokens_mean"] < G.get_profile("tiny").num_patches for r in records)


def test_a_failing_phase_is_recorded_and_written(tmp_path):
    results = {"phases": {}}
    assert not G.run_phase(results, "fora", lambda: {"x": 1 / 0}, tmp_path)
    assert G.run_phase(results, "inprocess", lambda: {"ratio": 1.0}, tmp_path)
    written = json.loads((tmp_path / "gpu_scale.json").read_text())["phases"]
    assert written["fora"]["error"].startswith("ZeroDivisionError") and not written["fora"]["ok"]
    assert written["inprocess"]["ok"] and written["inprocess"]["ratio"] == 1.0


def results_of(probed_run, *, fora_ok: bool) -> dict:
    args, folder = probed_run
    spans, records = G.read_probes(folder), read_metrics(folder)
    settings = {"sim": "sims/usl_vqarad", "profile": "tiny", "dtype": "bf16", "wire": "bf16", "cuts": [1, 3],
                "lora_rank": 4, "patches": 16, "hidden": 32, "dataset": "easyvqa", "clients": 2, "rounds": 3,
                "steps": 2, "batch_size": 2, "client_gpus": 0.5, "repeats": 2}
    fora = ({"ok": True, "wall_s": 30.0, "replay_s": 29.0, "peak_bytes": 3 * G.GIB, "options": G.FORA_OPTIONS,
             "aux_rows": 8, "observed_samples": 2, "mean_kept_tokens": 8.0, "metrics": {"psnr": 9.1,
                                                                                           "baseline_psnr": 9.5}}
            if fora_ok else {"ok": False, "wall_s": 3.0, "error": "RuntimeError: Expected all tensors on one device"})
    return {
        "provenance": {"commit": "0123456789ab", "measured": "2026-01-01 00:00 UTC", "machine": "x86_64"},
        "device": {"device": "cuda", "torch": "2.13.0+cu128", "cuda": "12.8", "gpu": "NVIDIA H100 80GB HBM3",
                   "gpu_memory_bytes": 80 * 10**9, "driver": "570.124.06"},
        "settings": settings,
        "phases": {
            "dtp_artifact": {"ok": True, "wall_s": 2.0, "folder": "/tmp/dtp"},
            "flwr_run": {"ok": True, "wall_s": 100.0, "run_folder": str(folder), "flwr_run_s": 99.0,
                         "rounds": [{key: r.get(key) for key in G.ROUND_KEYS} for r in records],
                         "per_step": G.party_accounting(spans), "processes": G.process_memory(spans),
                         "wire": G.wire_per_step(records, 32, args.batch_size)},
            "fora": fora,
            "inprocess": {"ok": True, "wall_s": 60.0, "steps": 2, "inprocess_round_s": 1.1, "unsplit_s": 1.0,
                          "inprocess_rounds_s": [1.1, 1.2], "unsplit_runs_s": [1.0, 1.0], "ratio": 1.1,
                          "mini_target": 1.15, "peak_bytes": 40 * G.GIB},
        },
        "wall_s": 200.0,
    }


def test_the_report_stamps_the_gpu_and_renders_from_its_json_alone(probed_run, tmp_path):
    results = results_of(probed_run, fora_ok=True)
    G.write_json(G.NAME, results, tmp_path)
    assert G.main(["--report", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_scale.md").read_text()
    assert text == G.render_report(results, tmp_path).read_text()
    assert "**NVIDIA H100 80GB HBM3** (74.51 GiB, driver 570.124.06), torch 2.13.0+cu128 with CUDA 12.8" in text
    assert "- commit: `0123456789ab`" in text
    for section in ("## Phases", "## Per step, each party", "## Memory per process", "## The wire (round 2)",
                    "## FORA replay", "## In-process USL against the unsplit model"):
        assert section in text
    assert "**1.10×**" in text and "The whole check took 200 s." in text


def test_a_failed_phase_is_named_in_the_report_and_its_section_left_out(probed_run, tmp_path):
    text = G.render_report(results_of(probed_run, fora_ok=False), tmp_path).read_text()
    assert "| FORA replay on the recorded activations at CA | 3 | failed: RuntimeError: Expected all tensors" in text
    assert "## FORA replay" not in text and "## Per step, each party" in text
