"""`qpriv-mini`: build the offline mini models, ship a build with the code, and evaluate one on
its test split (easy-VQA; the scene testbed for mini-scenes)."""

import argparse
import json
from pathlib import Path

from vlm.answering import answer_questions
from vlm.features import VisionFeatureCache
from vlm.loading import ModelNotAvailableError
from vlm.mini.build import STAGES, MiniBuildFailed, MiniFolder, ShippedWeightsCorrupt, build_mini, load_mini, ship
from vlm.mini.recipe import RECIPES, SceneRecipe, recipe_for
from vlm.profiles import get_profile
from vqa import aggregate_accuracy, load_vqa


def _evaluate(profile: str, stage: str, limit: int | None, root: Path | None) -> dict:
    recipe = recipe_for(profile)
    try:
        bundle = load_mini(get_profile(profile), stage=stage, root=root)
    except ModelNotAvailableError:
        print(f"The {profile} model is not built yet: building it now (cached for every later run).")
        build_mini(recipe, root=root)
        bundle = load_mini(get_profile(profile), stage=stage, root=root)
    test = load_vqa(recipe.dataset if isinstance(recipe, SceneRecipe) else "easyvqa", "test", limit=limit)
    features = VisionFeatureCache(bundle.model, bundle.preprocess_images)
    cached = MiniFolder(recipe, root).features
    if cached.is_file():
        features.load(cached)
    predictions = answer_questions(bundle.model, bundle.tokenizer, features, test, instruction=recipe.instruction)
    report = aggregate_accuracy(predictions, test)
    return {
        "profile": profile,
        "stage": stage,
        "samples": len(test),
        "accuracy": report.overall.accuracy,
        "by_question_kind": {kind: group.accuracy for kind, group in report.by_question_kind.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qpriv-mini", description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $QPRIV_CACHE_DIR)")
    parser.add_argument("--profile", choices=list(RECIPES), default="mini",
                        help="which mini model: mini, mini-positional (its visual rows keep their patch position), "
                             "mini-interleaved (its base learned from in-context demonstrations) or mini-scenes "
                             "(the scene testbed: local visual rows)")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser(
        "build", help="install the shipped weights of the profile's recipe where they exist, else train the model "
                      "(resumes an interrupted build)")
    build.add_argument("--from-scratch", action="store_true",
                       help="train even where weights ship (two builds of one recipe on one kind of machine give "
                            "the same weights digest)")
    commands.add_parser("ship", help="copy the finished build into vlm/mini/shipped/ to commit with the code")
    evaluate = commands.add_parser("evaluate", help="accuracy on the easy-VQA test split (builds first if needed)")
    evaluate.add_argument("--stage", choices=STAGES, default="vqa")
    evaluate.add_argument("--limit", type=int, default=None, help="score a seeded random subset of this size")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            folder = build_mini(recipe_for(args.profile), root=args.cache_dir, from_scratch=args.from_scratch)
            print(json.dumps(folder.read_report(), indent=2))
            print(f"built in {folder.path}")
        elif args.command == "ship":
            print(f"shipped in {ship(recipe_for(args.profile), root=args.cache_dir)}")
        else:
            print(json.dumps(_evaluate(args.profile, args.stage, args.limit, args.cache_dir), indent=2))
    except (MiniBuildFailed, ShippedWeightsCorrupt, ModelNotAvailableError) as failure:
        parser.exit(1, f"qpriv-mini: {failure}\n")


if __name__ == "__main__":
    main()
