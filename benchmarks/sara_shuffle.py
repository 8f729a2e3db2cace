"""Seed 002's headline on unpruned rows, and the probes that say whether it can show at all.

    python benchmarks/sara_shuffle.py [--profiles mini,mini-positional] [--aux 768] [--victims 128]
                                      [--probe-images 512] [--probes linear,mlp] [--sara-option KEY=VALUE ...]
    python benchmarks/sara_shuffle.py --report

Shuffling the visual rows a client sends defeats a plain decoder (paper, ViT-B/16 split
inference: SSIM 0.700 aligned, 0.246 shuffled), but not SARA, whose token-position
predictor puts the rows back (attacks/sara.py). Per mini profile, on the first cut of an SL
run and unpruned rows:

1. the position probes (attacks/position_probes.py): how much of its patch position a row
   carries at each vision layer and at the cut;
2. one SARA fitted as the paper fits it (`stage_inputs="paper"`: its decoder learns to invert
   full aligned grids, its TPP to place shuffled rows) on `--aux` training images; then on
   `--victims` other training images: that decoder on aligned rows, the same decoder on the
   rows shuffled and read in arrival order (the plain decoder against shuffling), and SARA on
   the shuffled rows (TPP placement, MAE for positions left empty by collisions, decoder).

`mini` keeps almost no position by its feature layer and `mini-positional` keeps it
(docs/models.md): the difference is what a position-recovery attack needs. SARA's
budgets are the paper's epochs and rates unless `--sara-option` overrides them; one torch
thread. Writes results/sara_shuffle.json, .md (rendered from the JSON) and .png (`--name` for
another setting beside the paper's: results/sara_shuffle_tuned is `--profiles mini-positional
--probes linear --sara-option stage_inputs=chained --sara-option tpp_lr=1e-3 --sara-option
tpp_epochs=40 --sara-option mae_lr=1e-3 --name sara_shuffle_tuned`).
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attacks import build_attack
from attacks.cli import parse_option
from attacks.knowledge import visual_rows
from attacks.metrics import image_metrics
from attacks.position_probes import PROBES, PositionProbeOptions, position_probes
from attacks.sara import SARAOptions, position_metrics
from sims.privacy_cli import attacker_view
from vlm.profiles import profile_names

sys.path.insert(0, str(Path(__file__).parent))
from report import (  # noqa: E402
    REPORT_HELP, RESULTS, add_allow_dirty, markdown_table, percent, provenance_for, read_json, write_json, write_markdown,
)

NAME = "sara_shuffle"
COMMAND = "python benchmarks/sara_shuffle.py"
STAGE, DATASET = "base", "easyvqa-stamped"
PAPER = {"aligned_ssim": 0.700, "shuffled_ssim": 0.246}
READS = {"aligned": "decoder, aligned rows", "shuffled": "decoder, shuffled rows in arrival order",
         "sara": "SARA on shuffled rows"}


def measure_profile(profile: str, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The profile's measurements (for the JSON), and six victims' images per read (for the plot only)."""
    start = time.perf_counter()
    knowledge, samples = attacker_view(profile, STAGE, DATASET, args.aux + args.victims, seed=args.seed)
    aux, victims = samples[: args.aux], samples[args.aux :]
    probe_options = PositionProbeOptions(probes=args.probes, seed=args.seed)
    places = position_probes(knowledge, samples[: args.probe_images], probe_options, progress=not args.no_progress)
    probed = time.perf_counter()

    # Unpruned sends; the MAE learns to fill up to half the grid (what collisions leave empty).
    options = {"keep_ratios": (1.0, 1.0), "shuffle": True, "stage_inputs": "paper", "mae_mask_ratios": (0.0, 0.5),
               "seed": args.seed, "progress": not args.no_progress, **dict(args.sara_option)}
    sara = build_attack("sara", knowledge, **options).fit(aux)
    fitted = time.perf_counter()
    n = knowledge.num_patches
    generator = torch.Generator().manual_seed(args.seed + 1)
    orders = [torch.randperm(n, generator=generator) for _ in victims]
    pixels = knowledge.pixel_values(victims)
    targets = knowledge.unit_images(pixels)
    with torch.no_grad():
        features = knowledge.features(pixels)
        aligned = visual_rows(knowledge.model, features, knowledge.prefix_ids, knowledge.first_cut)
        shuffled = visual_rows(knowledge.model, features, knowledge.prefix_ids, knowledge.first_cut, orders)
        restored, slots = sara.reconstruct(shuffled)
        images = {"aligned": sara.decoder(torch.stack(aligned).float()),
                  "shuffled": sara.reconstruct_without_positions(shuffled), "sara": restored}
    examples = {read: image[:6] for read, image in images.items()} | {"target": targets[:6]}
    return {
        "profile": profile,
        "num_patches": n,
        "first_cut": knowledge.first_cut,
        "probes": [place.to_dict() for place in places],
        "sara_options": {k: v for k, v in options.items() if k != "progress"},
        "reconstruction": {read: image_metrics(image, targets) for read, image in images.items()},
        "positions": position_metrics(slots, orders, n),
        "seconds": {"probes": probed - start, "fit": fitted - probed, "total": time.perf_counter() - start},
    }, examples


def plot(results: dict, examples: list[dict[str, torch.Tensor]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = results["profiles"]
    rows = 1 + len(profiles)
    fig = plt.figure(figsize=(11, 2.6 * rows))
    grid = fig.add_gridspec(rows, 2, width_ratios=[1.2, 1])
    ax = fig.add_subplot(grid[0, 0])
    width = 0.8 / len(profiles)
    for i, p in enumerate(profiles):
        ax.bar([x + (i - (len(profiles) - 1) / 2) * width for x in range(len(READS))],
               [p["reconstruction"][read]["ssim"] for read in READS], width, label=p["profile"])
    ax.axhline(PAPER["aligned_ssim"], color="grey", linestyle=":", label="paper, aligned")
    ax.axhline(PAPER["shuffled_ssim"], color="grey", linestyle="--", label="paper, shuffled")
    ax.set_xticks(range(len(READS)), list(READS.values()), fontsize=7)
    ax.set_ylabel("SSIM (victims)")
    ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[0, 1])
    for p in profiles:
        for probe in results["settings"]["probes"]:
            ax.plot([q["place"] for q in p["probes"]], [q["accuracy"][probe] for q in p["probes"]], marker="o",
                    label=f"{p['profile']}, {probe}")
    ax.axhline(1 / profiles[0]["num_patches"], color="grey", linestyle="--", label="chance")
    ax.tick_params(axis="x", labelrotation=25, labelsize=6)
    ax.set_ylabel("position probe accuracy")
    ax.legend(fontsize=6)
    for row, (p, images) in enumerate(zip(profiles, examples, strict=True), start=1):
        ax = fig.add_subplot(grid[row, :])
        strips = [torch.cat(list(images[read]), dim=2) for read in ("target", *READS)]
        ax.imshow(torch.cat(strips, dim=1).permute(1, 2, 0).clamp(0, 1).numpy())
        ax.set_title(f"{p['profile']}: rows top to bottom: target, " + ", ".join(READS.values()), fontsize=8)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_report(results: dict, folder: Path | None = None, name: str = NAME) -> Path:
    folder = folder or RESULTS
    s = results["settings"]
    intro = (
        f"Profiles {', '.join(p['profile'] for p in results['profiles'])} ({STAGE}), the first cut of an SL run, "
        f"unpruned rows. SARA fitted on {s['aux']} training images, scored on {s['victims']} others; probes on "
        f"{s['probe_images']} images (a quarter held out). The paper (ViT-B/16): SSIM {PAPER['aligned_ssim']} aligned, "
        f"{PAPER['shuffled_ssim']} shuffled, and SARA near the aligned value."
    )
    reconstruction = markdown_table(
        ["profile", "read", "SSIM", "PSNR (dB)", "FSIM"],
        [[p["profile"], READS[read], f"{m['ssim']:.3f}", f"{m['psnr']:.2f}", f"{m['fsim']:.3f}"]
         for p in results["profiles"] for read, m in p["reconstruction"].items()],
    )
    positions = markdown_table(
        ["profile", "SARA position accuracy", "chance", "SARA options", "fit s", "total s"],
        [[p["profile"], percent(p["positions"]["position_accuracy"]), percent(p["positions"]["chance_position_accuracy"]),
          ", ".join(f"{k}={v}" for k, v in p["sara_options"].items()), f"{p['seconds']['fit']:.0f}",
          f"{p['seconds']['total']:.0f}"] for p in results["profiles"]],
    )
    probes = markdown_table(
        ["profile", "place", *[f"{probe} probe" for probe in s["probes"]]],
        [[p["profile"], q["place"], *[percent(q["accuracy"][probe]) for probe in s["probes"]]]
         for p in results["profiles"] for q in p["probes"]],
    )
    body = "\n\n".join([intro, "## Reconstruction of the victims' images", reconstruction,
                        "## Where SARA put the shuffled rows", positions,
                        "## Patch position per row (held-out images)", probes, f"![SSIM, probes and examples]({name}.png)",
                        f"Load while measuring: {results['load'] or 'not recorded'}."])
    return write_markdown(name, "SARA against shuffled rows, and the position they carry", body,
                          results.get("provenance"), command=COMMAND if name == NAME else f"{COMMAND} --name {name}",
                          folder=folder)


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag, value in (("--aux", args.aux), ("--victims", args.victims), ("--probe-images", args.probe_images)):
        if value < 2:
            parser.error(f"{flag} {value}: must be at least 2")
    probes = tuple(p.strip() for p in args.probes.split(",") if p.strip())
    if not probes or any(p not in PROBES for p in probes):
        parser.error(f"--probes {args.probes!r}: a comma-separated subset of {', '.join(PROBES)}")
    args.probes = probes
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    unknown = [p for p in profiles if p not in profile_names()]
    if not profiles or unknown:
        parser.error(f"--profiles {args.profiles!r}: known profiles are {', '.join(profile_names())}")
    args.profiles = profiles
    try:
        SARAOptions(**{"keep_ratios": (1.0, 1.0), "mae_mask_ratios": (0.0, 0.5), **dict(args.sara_option)})
    except (TypeError, ValueError) as error:
        parser.error(f"--sara-option: {error}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="mini,mini-positional", help="comma-separated model profiles")
    parser.add_argument("--aux", type=int, default=768, help="training images SARA learns from")
    parser.add_argument("--victims", type=int, default=128, help="other training images it reconstructs")
    parser.add_argument("--probe-images", type=int, default=512, help="images the position probes use")
    parser.add_argument("--probes", default="linear,mlp", help="comma-separated: linear, mlp")
    parser.add_argument("--sara-option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                        help="a SARA option over the paper's (attacks/sara.py), e.g. tpp_lr=1e-3; repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", default="", help="what else ran on the machine (kept in the JSON)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--name", default=NAME, help="the results' file names (another setting beside the paper's)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--report", action="store_true", help=REPORT_HELP)
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.report:
        print(f"wrote {render_report(read_json(args.name, args.out), args.out, args.name)}")
        return
    check_arguments(args, parser)
    torch.set_num_threads(1)
    # Every draw here (the images, SARA, the probes) is seeded from --seed.
    results = {"provenance": provenance_for(args, seeds={"seed": args.seed}, models=args.profiles), "load": args.load,
               "settings": {"aux": args.aux, "victims": args.victims, "probe_images": args.probe_images,
                            "probes": list(args.probes), "seed": args.seed},
               "profiles": []}
    examples = []
    for profile in args.profiles:
        measured, images = measure_profile(profile, args)
        results["profiles"].append(measured)
        examples.append(images)
    write_json(args.name, results, args.out)
    plot(results, examples, args.out / f"{args.name}.png")
    print(render_report(read_json(args.name, args.out), args.out, args.name).read_text())


if __name__ == "__main__":
    main()
