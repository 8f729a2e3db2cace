"""`qpriv-privacy mtv`: seed 003's task vectors on one client's private set (central DP-MTV), scored
against zero-shot and K-shot in-context answering on the client's test share.

    qpriv-privacy mtv --profile mini-interleaved [--stage base] [--private 400] [--public 200] [--test 500]
                      [--chunks 64] [--shots 4] [--clip auto] [--epsilons 0.5,1,2,5,inf] [--delta 1e-4]
                      [--selection public|private] [--selection-epsilon 0.2] [--layers all]
                      [--reinforce-steps 100] [--seed 0] [--threads 1] [--out DIR]

The data is a one-client run's (training.data.RunData): the client's --private training rows,
its --test share, and --public rows of the run's auxiliary split that no client holds (the public
queries REINFORCE learns the head mask on). K-shot answers each test question after --shots
demonstrations drawn from the private set; MTV is the task vector at ε = inf; DP-MTV the same
chunks released at each finite ε. `--clip auto` sets C to the median per-layer norm of
chunk activations built from the public rows (public: no privacy cost).

Writes DIR/mtv.json (every number, the settings, each vector's ledger), DIR/mtv.md, DIR/mtv.png
(accuracy against ε with the zero-shot, K-shot and MTV levels) and DIR/task_vector-eps<ε>.pt.
Each finished method is saved as it ends, so a killed run resumes at the method it lost (with
the same settings; changed settings start over). DIR defaults to ./mtv-<profile>-<stage>.
"""

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from privacy.base import OptionError
from privacy.dp_mtv import PRIVATE, PUBLIC, SELECTIONS, DPMTVOptions, build_task_vector, disjoint_chunks
from sims.usage import UsageError
from vlm.profiles import profile_names

STAGES = ("base", "vqa", "random")
NAME = "mtv"


@dataclass(frozen=True)
class MTVSettings:
    """Everything a report's numbers depend on (a rerun with other settings starts over)."""

    profile: str
    stage: str
    private: int
    test: int
    options: DPMTVOptions
    clip_auto: bool
    epsilons: tuple[float, ...]
    seed: int

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["epsilons"] = [str(e) for e in self.epsilons]
        return values


def parse_epsilons(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--epsilons {text!r}: comma-separated numbers > 0, or inf (non-private MTV)") from None
    if not values or any(not value > 0 for value in values):
        raise UsageError(f"--epsilons {text!r}: comma-separated numbers > 0, or inf (non-private MTV)")
    return tuple(sorted(set(values)))


def settings_from(args: argparse.Namespace) -> MTVSettings:
    clip_auto = args.clip == "auto"
    try:
        clip = 1.0 if clip_auto else float(args.clip)
    except ValueError:
        raise UsageError(f"--clip {args.clip!r}: a number > 0, or auto") from None
    for flag, value in (("--private", args.private), ("--public", args.public), ("--test", args.test),
                        ("--reinforce-steps", args.reinforce_steps)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    epsilons = parse_epsilons(args.epsilons)
    options = DPMTVOptions(chunks=args.chunks, shots=args.shots, clip=clip, epsilon=min(epsilons), delta=args.delta,
                           selection=args.selection, selection_epsilon=args.selection_epsilon,
                           layers="" if args.layers == "all" else args.layers, public_queries=args.public,
                           reinforce_steps=args.reinforce_steps)
    try:
        options.validate(args.private)
    except OptionError as error:
        flag = {"public_queries": "--public"}.get(error.option, "--" + error.option.replace("_", "-"))
        raise UsageError(f"{flag} {error.value}: {error.allowed}") from None
    return MTVSettings(args.profile, args.stage, args.private, args.test, options, clip_auto, epsilons, args.seed)


@dataclass
class Client:
    """One client's model, tokenizer, visual features and rows (a one-client run's data)."""

    model: Any
    tokenizer: Any
    features: Any
    instruction: str | None
    private: list
    public: list
    test: list


def load_client(settings: MTVSettings, progress: bool) -> Client:
    from config import load_config
    from training.data import RunData
    from training.model import load_bundle, prompt_instruction, resolve_device
    from vlm.features import VisionFeatureCache

    config = load_config({"model.profile": settings.profile, "model.stage": settings.stage, "model.seed": settings.seed,
                          "paradigm": "cl", "clients.count": 1, "data.train_limit": settings.private,
                          "data.test_limit": settings.test, "data.seed": settings.seed, "output.name": "mtv"})
    bundle = load_bundle(config, resolve_device(config.model.device))
    data = RunData.build(config)
    private, test = list(data.train_shard(0)), list(data.test_shard(0))
    public = data.auxiliary(settings.options.public_queries)
    features = VisionFeatureCache(bundle.model, bundle.preprocess_images)
    features.add([*private, *public, *test], progress=progress)
    return Client(bundle.model.eval(), data.tokenizer(bundle), features, prompt_instruction(bundle.profile),
                  private, public, test)


def accuracy(client: Client, *, demonstrations=None, vector=None) -> dict[str, Any]:
    from vlm.answering import answer_questions
    from vqa import aggregate_accuracy

    answers = answer_questions(client.model, client.tokenizer, client.features, client.test,
                               instruction=client.instruction, demonstrations=demonstrations,
                               intervention=vector.intervention(client.model) if vector is not None else None,
                               batch_size=64, max_new_tokens=3, progress=False)
    report = aggregate_accuracy(answers, client.test)
    return {"accuracy": report.overall.accuracy,
            "by_question_kind": {kind: group.accuracy for kind, group in report.by_question_kind.items()}}


def public_clip(client: Client, settings: MTVSettings) -> float:
    """The median per-layer norm of chunk activations built from the public rows."""
    from vlm.task_vectors import chunk_activations, head_layout

    options = settings.options
    chunks = max(1, min(options.chunks, len(client.public) // (options.shots + 1)))
    layout = head_layout(client.model, options.layer_indices)
    indices = disjoint_chunks(len(client.public), replace(options, chunks=chunks, epsilon=math.inf), settings.seed)
    activations = chunk_activations(client.model, client.tokenizer, client.features,
                                    [[client.public[i] for i in chunk] for chunk in indices], layout,
                                    instruction=client.instruction, progress=False)
    return float(activations.flatten(2).norm(dim=-1).median())


def run_mtv(args: argparse.Namespace) -> Path:
    settings = settings_from(args)
    out = Path(args.out or f"mtv-{settings.profile}-{settings.stage}").expanduser()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    path = out / f"{NAME}.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    results: dict[str, Any] = saved if saved.get("settings") == settings.to_dict() else {"settings": settings.to_dict()}
    results.setdefault("methods", {})

    def save() -> None:
        path.write_text(json.dumps(results, indent=2, default=str))

    progress = not args.no_progress
    client = load_client(settings, progress)
    options = settings.options
    if settings.clip_auto:
        results.setdefault("clip", public_clip(client, settings))
        options = replace(options, clip=results["clip"])
    methods = results["methods"]

    def measure(label: str, work) -> None:
        if label in methods:
            return
        started = time.perf_counter()
        outcome = work()
        methods[label] = {**outcome, "seconds": round(time.perf_counter() - started, 1)}
        save()
        print(f"{label}: {methods[label]['accuracy']:.1%}", flush=True)

    measure("zero-shot", lambda: accuracy(client))
    rng = random.Random(settings.seed)
    demonstrations = [rng.sample(client.private, options.shots) for _ in client.test]
    measure(f"{options.shots}-shot in context", lambda: accuracy(client, demonstrations=demonstrations))
    for epsilon in sorted(settings.epsilons, reverse=True):
        label = "MTV (ε = inf)" if math.isinf(epsilon) else f"DP-MTV (ε_tv = {epsilon:g})"

        def with_vector(epsilon: float = epsilon) -> dict[str, Any]:
            vector = build_task_vector(client.model, client.tokenizer, client.features, client.private,
                                       client.public, replace(options, epsilon=epsilon),
                                       instruction=client.instruction, seed=settings.seed, progress=progress)
            vector.save(out / f"task_vector-eps{epsilon:g}.pt")
            return {**accuracy(client, vector=vector), "epsilon_tv": epsilon, "ledger": vector.ledger.to_dict(),
                    "report": {k: v for k, v in vector.report.items() if k != "ledger"}}

        measure(label, with_vector)
    (out / f"{NAME}.md").write_text(mtv_report(results))
    mtv_plot(results, out / f"{NAME}.png")
    return out


def mtv_report(results: dict[str, Any]) -> str:
    s = results["settings"]
    o = s["options"]
    clip = f"{results['clip']:.3g} (auto: the public chunks' median per-layer norm)" if "clip" in results else o["clip"]
    lines = [f"# Task vectors on {s['profile']} ({s['stage']})", "",
             f"{s['private']} private training rows in {o['chunks']} chunks of {o['shots']} demonstrations and a target; "
             f"{o['public_queries']} public rows; {s['test']} test questions. C = {clip}, δ = {o['delta']:g}; head selection "
             f"{o['selection']} ({SELECTIONS[o['selection']]}). Seed {s['seed']}.", "",
             "| method | accuracy | by question kind | ε (total) | heads replaced | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for label, m in results["methods"].items():
        kinds = ", ".join(f"{k} {v:.1%}" for k, v in m["by_question_kind"].items())
        epsilon = f"{m['ledger']['epsilon']:g}" if "ledger" in m else "—"
        heads = m["report"]["selected_heads"] if "report" in m else "—"
        lines.append(f"| {label} | {m['accuracy']:.1%} | {kinds} | {epsilon} | {heads} | {m['seconds']} |")
    return "\n".join(lines) + "\n"


def mtv_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    private = [(m["epsilon_tv"], m["accuracy"]) for m in methods.values() if math.isfinite(m.get("epsilon_tv", math.inf))]
    fig, ax = plt.subplots(figsize=(6, 4))
    if private:
        xs, ys = zip(*sorted(private))
        ax.plot(xs, ys, "o-", label="DP-MTV")
    for label, style in (("zero-shot", "k--"), ("MTV (ε = inf)", "g-")):
        if label in methods:
            ax.axhline(methods[label]["accuracy"], linestyle=style[1:], color=style[0], label=label)
    shots = [label for label in methods if label.endswith("in context")]
    if shots:
        ax.axhline(methods[shots[0]]["accuracy"], linestyle=":", color="tab:orange", label=shots[0])
    ax.set_xscale("log")
    ax.set_xlabel("ε_tv")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Task vectors, {results['settings']['profile']} ({results['settings']['stage']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_command(commands) -> argparse.ArgumentParser:
    mtv = commands.add_parser("mtv", help="task vectors (DP-MTV) on one client's private set, against in-context answering")
    mtv.add_argument("--profile", default="mini-interleaved", choices=profile_names())
    mtv.add_argument("--stage", default="base", choices=STAGES)
    mtv.add_argument("--private", type=int, default=400, help="the client's private training rows")
    mtv.add_argument("--public", type=int, default=200, help="public rows (head selection, --clip auto)")
    mtv.add_argument("--test", type=int, default=500, help="test questions scored")
    mtv.add_argument("--chunks", type=int, default=64, help="m: disjoint chunks of the private rows")
    mtv.add_argument("--shots", type=int, default=4, help="K: demonstrations per chunk (and for K-shot)")
    mtv.add_argument("--clip", default="auto", help="C, each chunk's per-layer norm bound, or auto")
    mtv.add_argument("--epsilons", default="0.5,1,2,5,inf", help="ε_tv values (inf: non-private MTV)")
    mtv.add_argument("--delta", type=float, default=1e-4)
    mtv.add_argument("--selection", choices=(PUBLIC, PRIVATE), default=PUBLIC)
    mtv.add_argument("--selection-epsilon", type=float, default=0.2, help="ε_sel under --selection private")
    mtv.add_argument("--layers", default="all", help="decoder layers the vector covers: all, or e.g. 2,3,4")
    mtv.add_argument("--reinforce-steps", type=int, default=100, help="REINFORCE steps of public head selection")
    mtv.add_argument("--seed", type=int, default=0, help="data draw, chunks, noise and REINFORCE")
    mtv.add_argument("--out", help="the report folder (default ./mtv-<profile>-<stage>)")
    mtv.add_argument("--threads", type=int, default=1, help="torch threads")
    mtv.add_argument("--no-progress", action="store_true", help="no progress bar")
    return mtv
