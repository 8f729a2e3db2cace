"""What each vision-edge defense costs in accuracy before any fine-tuning under it.

    python benchmarks/edge_accuracy.py [--profiles mini,mini-positional] [--limit 500]
                                       [--positionless k2=DIR ...] [--load "..."]
    python benchmarks/edge_accuracy.py --report

The VQA-stage mini model (fine-tuned without any edge defense) answers the easy-VQA test
questions with each token operation in its vision tower (privacy/: shuffle, ToMe r, drop r)
and with each positionless edge given (`--positionless LABEL=DIR`, folders
`qpriv-privacy positionless` wrote; each on the profile it was prepared for), through the clients' own edge
(privacy.edge) and the same greedy answering and scoring as the mini model's targets
(vlm.answering). The decoder reads the visual rows at its rotary positions and was trained
on them in patch order and complete, so this is the cost before the model adapts; the
vision-edge sweep's runs, fine-tuned under each operation, give the cost after. Random
operations draw per test batch from a fixed seed. One torch thread. Writes
results/edge_accuracy.json and .md (rendered from the JSON).
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from analysis.provenance import seeds_of
from config import SimConfig, load_config
from privacy import EVAL, DefenseChain, DefenseSeed, OptionError, defense_class, options_from
from privacy.edge import check_edge, edge_vision_tokens
from training.data import RunData
from training.model import load_party_model
from vlm.answering import answer_questions
from vlm.features import VisionFeatureCache
from vlm.profiles import get_profile
from vqa import aggregate_accuracy

sys.path.insert(0, str(Path(__file__).parent))
from report import (  # noqa: E402
    REPORT_HELP, RESULTS, add_allow_dirty, markdown_table, percent, provenance_for, read_json, write_json, write_markdown,
)

NAME = "edge_accuracy"
COMMAND = "python benchmarks/edge_accuracy.py"
# label -> (defenses, their options)
OPERATIONS: dict[str, tuple[list[str], dict[str, dict[str, Any]]]] = {
    "none": ([], {}),
    "shuffle": (["shuffle"], {}),
    **{f"tome-{r}": (["tome"], {"tome": {"r": r}}) for r in (4, 8, 16)},
    **{f"drop-{r}": (["drop"], {"drop": {"r": r}}) for r in (4, 8, 16)},
}


def chain_of(names: list[str], options: dict[str, dict[str, Any]]) -> DefenseChain:
    return DefenseChain.build(names, {n: options_from(defense_class(n), options.get(n, {})) for n in names})


def config_for(profile: str, args: argparse.Namespace) -> SimConfig:
    return load_config({"model.profile": profile, "model.stage": "vqa", "paradigm": "sl", "clients.count": 1,
                        "data.train_limit": 1, "data.test_limit": args.limit, "output.name": "edge-accuracy"})


def measure_profile(profile: str, args: argparse.Namespace) -> dict[str, Any]:
    config = config_for(profile, args)
    party = load_party_model(config)
    data = RunData.build(config)
    tokenizer = data.tokenizer(party.bundle)
    test = list(data.test_shard(0))
    features = VisionFeatureCache(party.model, party.bundle.preprocess_images)
    features.add(test, progress=not args.no_progress)
    operations = dict(OPERATIONS)
    for label, folder in args.positionless:
        if json.loads((Path(folder) / "manifest.json").read_text())["profile"] == profile:
            operations[f"positionless-{label}"] = (["positionless"], {"positionless": {"artifact": folder}})
    rows = []
    shape = get_profile(profile)
    for label, (names, options) in operations.items():
        start = time.perf_counter()
        chain = chain_of(names, options)
        try:
            check_edge(chain, shape.num_patches, shape.vision_blocks)
        except OptionError as error:
            print(f"{profile} {label}: not run ({error})", flush=True)
            continue
        edge_tokens: dict[str, torch.Tensor] = {}
        if names:
            for index in range(0, len(test), args.batch_size):
                batch = test[index : index + args.batch_size]
                pixels = party.bundle.preprocess_images([s.image for s in batch]).to(party.device)
                seed = DefenseSeed(args.seed, 0, 0, index // args.batch_size, EVAL)
                output = edge_vision_tokens(party.model, pixels.to(features[batch[0].image_id].dtype), chain, seed)
                edge_tokens.update({s.id: tokens.cpu() for s, tokens in zip(batch, output.tokens, strict=True)})
        transform = (lambda sample, tokens: edge_tokens[sample.id]) if names else None
        predictions = answer_questions(party.model, tokenizer, features, test, instruction=party.instruction,
                                       visual_tokens=transform, batch_size=args.batch_size, progress=False)
        report = aggregate_accuracy(predictions, test)
        sent = sum(t.shape[0] for t in edge_tokens.values()) / len(edge_tokens) if edge_tokens else None
        rows.append({"operation": label, "accuracy": report.overall.accuracy, "tokens": sent,
                     "seconds": time.perf_counter() - start})
        print(f"{profile} {label}: {report.overall.accuracy:.3f}", flush=True)
    return {"profile": profile, "patches": shape.num_patches, "samples": len(test),
            "operations": rows}


def render_report(results: dict[str, Any], folder: Path) -> Path:
    parts = [
        f"VQA-stage models, easy-VQA test ({results['settings']['limit']} questions at most), each vision-edge "
        "defense in the tower at evaluation only: the accuracy cost before fine-tuning under it. "
        f"Load during the measurement: {results['load'] or 'not recorded'}.", ""]
    for profile in results["profiles"]:
        base = next(r["accuracy"] for r in profile["operations"] if r["operation"] == "none")
        parts += [f"## {profile['profile']} ({profile['samples']} questions, {profile['patches']} patches)", "",
                  markdown_table(["operation", "tokens sent", "accuracy", "vs none"],
                                 [[r["operation"], r["tokens"] if r["tokens"] is not None else profile["patches"],
                                   percent(r["accuracy"]), f"{100 * (r['accuracy'] - base):+.1f} pt"]
                                  for r in profile["operations"]]), ""]
    return write_markdown(NAME, "Accuracy of the vision-edge defenses before fine-tuning", "\n".join(parts),
                          results.get("provenance"), command=COMMAND, folder=folder)


def positionless_edge(text: str) -> tuple[str, str]:
    label, sep, folder = text.partition("=")
    if not sep or not label or not folder:
        raise argparse.ArgumentTypeError(f"--positionless {text!r}: expected LABEL=DIR")
    if not (Path(folder).expanduser() / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"--positionless {text!r}: {folder} holds no manifest.json "
                                         "(write it with `qpriv-privacy positionless`)")
    return label, str(Path(folder).expanduser())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="mini,mini-positional", help="comma-separated model profiles")
    parser.add_argument("--limit", type=int, default=500, help="easy-VQA test questions at most")
    parser.add_argument("--positionless", type=positionless_edge, action="append", default=[], metavar="LABEL=DIR",
                        help="a positionless edge (repeatable; each runs on the profile it was prepared for)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the random operations' draws")
    parser.add_argument("--load", default="", help="what else ran on the machine (kept in the JSON)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.report:
        print(f"wrote {render_report(read_json(NAME, args.out), args.out)}")
        return
    profiles = [p for p in args.profiles.split(",") if p]
    if args.limit < 1:
        parser.error(f"--limit {args.limit}: at least 1")
    torch.set_num_threads(1)
    # The data's seeds are the config's, the same for every profile; --seed draws the operations'.
    seeds = {**seeds_of(config_for(profiles[0], args).to_flat()), "seed": args.seed} if profiles else {"seed": args.seed}
    results = {"provenance": provenance_for(args, seeds=seeds, models=profiles), "load": args.load,
               "settings": {"limit": args.limit, "seed": args.seed, "positionless": dict(args.positionless)},
               "profiles": [measure_profile(profile, args) for profile in profiles]}
    write_json(NAME, results, args.out)
    print(render_report(read_json(NAME, args.out), args.out).read_text())


if __name__ == "__main__":
    main()
