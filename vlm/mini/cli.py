"""`qpriv-mini`: build the offline mini model and evaluate it on the easy-VQA test split."""

import argparse
import json
from pathlib import Path

from vlm.answering import answer_questions
from vlm.features import VisionFeatureCache
from vlm.loading import ModelNotAvailableError
from vlm.mini.build import STAGES, MiniBuildFailed, MiniFolder, build_mini, load_mini
from vlm.mini.recipe import MiniRecipe
from vqa import aggregate_accuracy, load_vqa


def _evaluate(stage: str, limit: int | None, root: Path | None) -> dict:
    recipe = MiniRecipe()
    try:
        bundle = load_mini(stage=stage, recipe=recipe, root=root)
    except ModelNotAvailableError:
        print("The mini model is not built yet: building it now (cached for every later run).")
        build_mini(recipe, root=root)
        bundle = load_mini(stage=stage, recipe=recipe, root=root)
    test = load_vqa("easyvqa", "test", limit=limit)
    features = VisionFeatureCache(bundle.model, bundle.preprocess_images)
    features.load(MiniFolder(recipe, root).features)
    predictions = answer_questions(bundle.model, bundle.tokenizer, features, test, instruction=recipe.instruction)
    report = aggregate_accuracy(predictions, test)
    return {
        "stage": stage,
        "samples": len(test),
        "accuracy": report.overall.accuracy,
        "by_question_kind": {kind: group.accuracy for kind, group in report.by_question_kind.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qpriv-mini", description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $QPRIV_CACHE_DIR)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="train the mini model (resumes an interrupted build)")
    evaluate = commands.add_parser("evaluate", help="accuracy on the easy-VQA test split (builds first if needed)")
    evaluate.add_argument("--stage", choices=STAGES, default="vqa")
    evaluate.add_argument("--limit", type=int, default=None, help="score a seeded random subset of this size")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            folder = build_mini(MiniRecipe(), root=args.cache_dir)
            print(json.dumps(folder.read_report(), indent=2))
            print(f"built in {folder.path}")
        else:
            print(json.dumps(_evaluate(args.stage, args.limit, args.cache_dir), indent=2))
    except MiniBuildFailed as failure:
        parser.exit(1, f"qpriv-mini: {failure}\n")


if __name__ == "__main__":
    main()
