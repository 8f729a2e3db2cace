"""`qpriv-prune`: prepare the DTP artefacts (oracle table, trained module) into a folder;
train a small profile's towers (`towers`)."""

import argparse
import json
from pathlib import Path

from pruning.prepare import PrepareError, PrepareSettings, prepare_dtp
from pruning.profiles import get_pruning_profile, pruning_profile_names
from pruning.towers import REPORT_FILE as TOWERS_REPORT
from pruning.towers import mini_tower_source, train_towers
from vlm.loading import ModelNotAvailableError
from vlm.mini.build import CACHE_ENV
from vqa import VQADataError

DEFAULTS = PrepareSettings()
TOWER_PROFILES = [name for name in pruning_profile_names() if get_pruning_profile(name).towers is not None]


def _source(text: str) -> tuple[str, str]:
    name, separator, location = text.partition("=")
    if not separator or not name or not location:
        raise argparse.ArgumentTypeError(f"--source {text!r}: expected NAME=PATH_OR_HUB_ID")
    return name, location


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qpriv-prune", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare",
        help="oracle grid search -> teacher (H_sens by MIL, MLPτ) -> distilled student; resumable",
        description="Each finished stage is cached in OUT/stages and skipped on a rerun with the same settings. "
        "OUT receives oracle.pt and dtp.pt (point a run's pruning.artifacts at it) and prepare.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    prepare.add_argument("--out", type=Path, required=True, help="artefacts folder (one per alpha/beta setting)")
    prepare.add_argument("--profile", default=DEFAULTS.profile)
    prepare.add_argument(
        "--model-stage",
        default=DEFAULTS.model_stage,
        help="vqa: the trained VQA model answers (mini's build, LLaVA-1.5's checkpoint); random: seeded random weights",
    )
    prepare.add_argument(
        "--model-source",
        default=DEFAULTS.model_source,
        metavar="DIR",
        help="LLaVA checkpoint folder (or a hub id in the local HF cache; empty: the profile's hub id there)",
    )
    prepare.add_argument(
        "--text-source", default=DEFAULTS.text_source, metavar="DIR", help="CLIP checkpoint folder for the text tower"
    )
    prepare.add_argument("--dino-source", default=DEFAULTS.dino_source, metavar="DIR", help="DINOv2 checkpoint folder")
    prepare.add_argument("--dtype", default=DEFAULTS.dtype, help="the answering model's dtype: fp32, bf16, fp16")
    prepare.add_argument("--device", default=DEFAULTS.device, help="where the answering model and encoders run")
    prepare.add_argument(
        "--dataset",
        dest="datasets",
        nargs="+",
        metavar="NAME",
        default=list(DEFAULTS.datasets),
        help="VQA datasets (training split + last split held out)",
    )
    prepare.add_argument(
        "--bags", nargs="+", metavar="NAME", default=list(DEFAULTS.bags), help="privacy bag sets for the H_sens teacher"
    )
    prepare.add_argument(
        "--source",
        dest="sources",
        type=_source,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a local copy (or cached hub id) for a dataset or bag set; repeatable",
    )
    prepare.add_argument(
        "--alpha", type=float, default=DEFAULTS.alpha, help="fusion weight of relevance (0: privacy only)"
    )
    prepare.add_argument("--beta", type=float, default=DEFAULTS.beta, help="fusion weight of sensitivity")
    prepare.add_argument("--seed", type=int, default=DEFAULTS.seed)
    prepare.add_argument("--samples", type=int, default=DEFAULTS.samples, help="training samples per dataset")
    prepare.add_argument(
        "--oracle-samples",
        type=int,
        default=DEFAULTS.oracle_samples,
        help="oracle-labelled training samples per dataset",
    )
    prepare.add_argument(
        "--eval-oracle-samples",
        type=int,
        default=DEFAULTS.eval_oracle_samples,
        help="held-out oracle samples per dataset, from its evaluation split (0: none)",
    )
    prepare.add_argument("--bag-samples", type=int, default=DEFAULTS.bag_samples, help="images per bag set and split")
    prepare.add_argument("--grid", type=float, nargs="+", default=list(DEFAULTS.grid), help="oracle prune ratios")
    prepare.add_argument(
        "--direction", default=DEFAULTS.direction,
        help="smallest (paper) or largest: the first matching ratio scanning from that end; "
             "stable: the largest ratio up to which every grid ratio matches",
    )
    prepare.add_argument(
        "--fixed-scorer",
        default=DEFAULTS.fixed_scorer,
        help="pretrained: the oracle's fixed scorer ranks with the trained towers' relevance read-out where the "
        "profile has them (random Wq/Wk otherwise); random: always random Wq/Wk",
    )
    prepare.add_argument(
        "--oracle-scorer",
        default=DEFAULTS.oracle_scorer,
        help="the oracle search's own fixed scorer, pretrained or random (the paper's); default: --fixed-scorer's. "
        "The teacher's mask, which the student's relevance distils, keeps --fixed-scorer's",
    )
    prepare.add_argument("--sensitivity-epochs", type=int, default=DEFAULTS.sensitivity_epochs)
    prepare.add_argument("--threshold-epochs", type=int, default=DEFAULTS.threshold_epochs)
    prepare.add_argument("--student-epochs", type=int, default=DEFAULTS.student_epochs)
    prepare.add_argument("--lr", type=float, default=DEFAULTS.lr)
    prepare.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size)
    prepare.add_argument("--lambda-ratio", type=float, default=DEFAULTS.lambda_ratio)
    prepare.add_argument("--lambda-mask", type=float, default=DEFAULTS.lambda_mask)
    prepare.add_argument("--quiet", action="store_true", help="no progress bars")
    towers = commands.add_parser(
        "towers",
        help="train a small profile's question and sensitivity towers once (profiles that name towers)",
        description="Trains the towers of a pruning profile that names them (pruning.towers) against its model "
        f"build, into the cache root ({CACHE_ENV}); resumable. prepare also builds them on first use.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    towers.add_argument(
        "--profile",
        default=next(iter(TOWER_PROFILES), None),
        choices=TOWER_PROFILES,
        help="a pruning profile with trained towers",
    )
    towers.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _towers(args: dict, parser: argparse.ArgumentParser) -> None:
    profile = get_pruning_profile(args["profile"])
    try:
        source = mini_tower_source(profile)
        folder = train_towers(profile, source, progress=not args["quiet"])
    except ModelNotAvailableError as error:
        parser.exit(1, f"qpriv-prune towers: {error}\n")
    report = json.loads((folder / TOWERS_REPORT).read_text())
    summary = {
        stage: {name: value for name, value in entry.items() if name != "epoch_losses"}
        for stage, entry in report["stages"].items()
    }
    print(json.dumps(summary, indent=2))
    print(f"towers of {profile.name} in {folder}")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args.pop("command") == "towers":
        _towers(args, parser)
        return
    out, quiet = args.pop("out"), args.pop("quiet")
    args["sources"] = dict(args["sources"])
    try:
        # Settings are checked on construction; the bag labels once their sets are read, before any model loads.
        report = prepare_dtp(PrepareSettings(**args), out, progress=not quiet)
    except PrepareError as error:
        parser.error(str(error))
    except (VQADataError, ModelNotAvailableError) as error:
        # Missing data or weights: the message already says what to supply; a traceback adds nothing.
        parser.exit(1, f"qpriv-prune prepare: {error}\n")
    summary = {
        stage: {name: value for name, value in entry.items() if name != "epoch_losses"}
        for stage, entry in report["stages"].items()
    }
    print(json.dumps(summary, indent=2))
    print(f"prepared in {report['seconds']:.1f} s; artefacts and report in {out}")


if __name__ == "__main__":
    main()
