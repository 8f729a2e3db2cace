"""`qpriv-privacy`: privacy analyses of a model. `paf`: each sub-layer's PAF in front of a cut (privacy.paf);
`positions`: how much patch position each visual token's row carries (attacks.position_probes);
`positionless`: prepare seed 002's positionless edge (privacy.positionless); `mtv`: seed 003's
task vectors on one client's private set, central DP-MTV (sims/mtv.py, which documents it).

    qpriv-privacy paf --profile mini [--stage base] [--cut 4] [--samples 16] [--directions 100]
                      [--tokens 8] [--tokens-from all|text|visual] [--theta pullback|output]
                      [--sigma eig|sv] [--reduce sum|norm] [--no-attention] [--seed 0]
                      [--threads 1] [--out DIR]

The decoder inputs are what a client's front receives in training (training.data.RunData:
the easy-VQA training rows of a run with `data.train_limit` = --samples and one client;
vision tower, projector, the prompt with its visual tokens and the answer), so each
sub-layer's Jacobian is taken at the inputs it really sees. Writes DIR/paf.json (every
number, the options, the definition read), DIR/paf.md (a table, one row per sub-layer)
and DIR/paf.png (PAF and max-PAF per sub-layer). DIR defaults to
./paf-<profile>-<stage>-cut<N>.

    qpriv-privacy positions --profile mini [--stage base] [--dataset easyvqa-stamped] [--images 512]
                            [--test-share 0.25] [--probes linear,mlp] [--seed 0] [--threads 1] [--out DIR]

Probes a row's patch index at every vision layer up to the feature layer and at the first
cut (patch order and shuffled), on --images distinct training images of the dataset, a
--test-share of them held out. Writes DIR/positions.json, .md (a table: accuracy per place
and probe against chance) and .png. DIR defaults to ./positions-<profile>-<stage>.

    qpriv-privacy positionless --profile mini [--stage vqa] [--blocks 1] [--steps 200] [--batch-size 8]
                               [--lr 1e-4] [--temperature 4] [--position-weight 0] [--rows 512]
                               [--held-out 64] [--seed 0] [--threads 1] [--stages STAGES] --out DIR

Seed 002's defense (privacy.positionless): the vision tower without positional embeddings,
distilled back to the model block by block (blocks 1..--blocks, --steps Adam steps each, on
--rows easy-VQA training rows; --position-weight > 0: the adversarial variant). Each block's
result is cached under STAGES (default DIR/stages) by its settings but k, so a killed run
resumes at the block it lost, a changed setting redoes the blocks, and edges sharing STAGES
share their first blocks. Writes DIR/tower.pt and DIR/manifest.json (the
artefact `privacy.positionless.artifact` selects), DIR/positionless.json and .md (held-out KL
to the original model: after removing the positions, after each block).

The commands live in sims/ because they build the model and data from a run config
(config, training, attacks); the analyses themselves (privacy.paf, attacks.position_probes)
take plain modules, tensors and samples.
"""

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from privacy.paf import ATTENTION, REDUCES, SIGMAS, SUBLAYERS, THETAS, PAFOptions, SubLayerPAF, front_paf
from sims import mtv as mtv_command
from sims.usage import UsageError
from vlm.profiles import get_profile, profile_names

STAGES = ("base", "vqa", "random")
# What `positionless` writes besides its report: the artefact a run config selects.
TOWER_FILE_NAMES = "tower.pt, manifest.json"
TOKEN_SETS = ("all", "text", "visual")


@dataclass
class Front:
    """What a client's front works on: the public model and tokenizer (AttackerKnowledge), the rows,
    their decoder inputs (vlm.segments.DecoderInputs) and the run's data (training.data.RunData)."""

    knowledge: Any
    rows: list
    inputs: Any
    data: Any


def load_front(profile: str, stage: str, samples: int, *, seed: int = 0, dataset: str = "easyvqa") -> Front:
    """The public model of an SL run on `profile` whose one client holds `samples` training rows of
    `dataset` (`data.train_limit`), those rows, and the decoder inputs its front gets for them in
    training (prompt, visual tokens, answer)."""
    from attacks.replay import knowledge_for_run
    from config import load_config
    from training.data import RunData
    from vlm.segments import merge_multimodal_inputs, project_visual_features

    # One client holding `samples` training rows: the run's data reads no more than it uses.
    config = load_config({"model.profile": profile, "model.stage": stage, "model.seed": seed, "paradigm": "sl",
                          "clients.count": 1, "data.dataset": dataset, "data.train_limit": samples, "data.test_limit": 1,
                          "output.name": "privacy-analysis"})
    knowledge = knowledge_for_run(config)
    data = RunData.build(config)
    rows = list(data.train_shard(0))
    with torch.no_grad():
        features = knowledge.features(knowledge.pixel_values(rows)).to(knowledge.device)
        visual = [project_visual_features(knowledge.model, features[i : i + 1])[0] for i in range(len(rows))]
        inputs = merge_multimodal_inputs(
            knowledge.model, [knowledge.prompt_ids(s.question) for s in rows], visual,
            [knowledge.answer_ids(s.answer) for s in rows],
        )
    return Front(knowledge, rows, inputs, data)


def check_paf_arguments(args: argparse.Namespace) -> None:
    layers = get_profile(args.profile).num_layers
    if args.cut is None:
        args.cut = get_profile(args.profile).sl_cut
    if not 1 <= args.cut <= layers:
        raise UsageError(
            f"--cut {args.cut}: profile {args.profile!r} has {layers} decoder layers, so a cut is in [1, {layers}] "
            f"(the layers in front of it are analysed; {layers} analyses all of them)"
        )
    for flag, value, least in (("--samples", args.samples, 1), ("--directions", args.directions, 1),
                               ("--tokens", args.tokens, 0), ("--threads", args.threads, 1)):
        if value < least:
            raise UsageError(f"{flag} {value}: must be at least {least}")


def paf_report(results: list[SubLayerPAF], meta: dict[str, Any]) -> str:
    o = meta["options"]
    lines = [
        f"# PAF per sub-layer: {meta['profile']} ({meta['stage']}), layers [0, {meta['cut']})",
        "",
        f"{meta['samples']} samples, {o['tokens_per_sample'] or 'all'} tokens each (from {meta['tokens_from']} tokens), "
        f"{o['directions']} Monte-Carlo "
        f"directions per Jacobian; reading theta={o['theta']}, sigma={o['sigma']}, reduce={o['reduce']} "
        "(privacy/paf.py). mean ± std across tokens; MC s.e. is the Monte-Carlo standard error of one token's "
        f"estimate; max-PAF is the worst direction's. {meta['seconds']:.1f} s.",
        "",
        "| layer | sub-layer | kind | J (m×n) | tokens | PAF | MC s.e. | max-PAF | worst token max-PAF | ‖J‖₂ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.layer} | {r.name} | {r.kind} | {r.shape[0]}×{r.shape[1]} | {r.tokens} | "
            f"{r.paf_mean:.3f} ± {r.paf_std:.3f} | {r.mc_stderr:.3f} | {r.max_paf_mean:.3f} ± {r.max_paf_std:.3f} | "
            f"{r.max_paf_max:.3f} | {r.norm_mean:.3f} |"
        )
    return "\n".join(lines) + "\n"


def paf_plot(results: list[SubLayerPAF], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(results) + 2), 4))
    ax.bar([i - 0.2 for i in x], [r.max_paf_mean for r in results], 0.4, label="max-PAF", color="tab:orange")
    ax.bar([i + 0.2 for i in x], [r.paf_mean for r in results], 0.4, yerr=[r.paf_std for r in results],
           label="PAF (mean ± std over tokens)", color="tab:blue")
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax.set_ylabel("PAF")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_paf(args: argparse.Namespace) -> Path:
    check_paf_arguments(args)
    options = PAFOptions(directions=args.directions, theta=args.theta, sigma=args.sigma, reduce=args.reduce,
                         tokens_per_sample=args.tokens, seed=args.seed)
    sublayers = tuple(name for name in SUBLAYERS if not (args.no_attention and name == ATTENTION))
    out = Path(args.out or f"paf-{args.profile}-{args.stage}-cut{args.cut}")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    front = load_front(args.profile, args.stage, args.samples, seed=args.seed)
    inputs = front.inputs
    token_mask = {"all": None, "text": ~inputs.visual_token_mask, "visual": inputs.visual_token_mask}[args.tokens_from]
    results = front_paf(front.knowledge.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids,
                        args.cut, options, sublayers=sublayers, token_mask=token_mask, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    meta = {"profile": args.profile, "stage": args.stage, "cut": args.cut, "samples": len(front.rows),
            "options": asdict(options), "tokens_from": args.tokens_from, "sublayers": list(sublayers), "seconds": seconds,
            "definition": "privacy/paf.py: PAF = E_δ Σ_i |‖J‖₂ cos θ_i / sqrt(σ_i + 1)|"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "paf.json").write_text(json.dumps({**meta, "layers": [r.to_dict() for r in results]}, indent=2))
    (out / "paf.md").write_text(paf_report(results, meta))
    paf_plot(results, out / "paf.png", f"PAF, {args.profile} ({args.stage}), layers [0, {args.cut})")
    return out


def check_positions_arguments(args: argparse.Namespace) -> None:
    from attacks.position_probes import PROBES

    if args.images < 2:
        raise UsageError(f"--images {args.images}: must be at least 2 (some train the probes, some score them)")
    if not 0 < args.test_share < 1:
        raise UsageError(f"--test-share {args.test_share}: must be in (0, 1)")
    probes = tuple(p.strip() for p in args.probes.split(",") if p.strip())
    unknown = [p for p in probes if p not in PROBES]
    if unknown or not probes:
        raise UsageError(f"--probes {args.probes!r}: a comma-separated subset of {', '.join(PROBES)}")
    args.probes = probes
    if args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be at least 1")


def positions_report(places: list, meta: dict[str, Any]) -> str:
    probes = meta["options"]["probes"]
    lines = [
        f"# Patch position per visual row: {meta['profile']} ({meta['stage']}), {meta['dataset']}",
        "",
        f"{meta['images']} distinct training images ({meta['options']['test_share']:.0%} held out to score), "
        f"{meta['num_patches']} patch positions (chance {1 / meta['num_patches']:.1%}); each probe reads one row's "
        "patch index (attacks/position_probes.py). The vision rows are the tower's, up to the feature layer LLaVA "
        f"reads (layer {meta['feature_layer']}); the cut rows are what a front sends at decoder layer "
        f"{meta['first_cut']}, in patch order or shuffled per image. {meta['seconds']:.0f} s.",
        "",
        "| place | width | " + " | ".join(f"{p} probe" for p in probes) + " |",
        "|---|---|" + "---|" * len(probes),
    ]
    for place in places:
        lines.append(f"| {place.place} | {place.width} | " + " | ".join(f"{place.accuracy[p]:.1%}" for p in probes) + " |")
    return "\n".join(lines) + "\n"


def positions_plot(places: list, meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = meta["options"]["probes"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(places) + 1), 3.8))
    width = 0.8 / len(probes)
    for i, probe in enumerate(probes):
        ax.bar([x + (i - (len(probes) - 1) / 2) * width for x in range(len(places))],
               [place.accuracy[probe] for place in places], width, label=f"{probe} probe")
    ax.axhline(1 / meta["num_patches"], color="grey", linestyle="--", label="chance")
    ax.set_xticks(range(len(places)), [place.place for place in places], rotation=25, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("patch position accuracy (held-out images)")
    ax.set_title(f"Position per visual row, {meta['profile']} ({meta['stage']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attacker_view(profile: str, stage: str, dataset: str, images: int, *, seed: int = 0) -> tuple[Any, list]:
    """The attacker of an SL run on `profile`: its public model and cuts (AttackerKnowledge), and
    `images` distinct training images of `dataset` that no client of this one-row run holds."""
    from attacks.position_probes import distinct_images
    from attacks.replay import knowledge_for_run
    from config import load_config
    from training.data import RunData

    config = load_config({"model.profile": profile, "model.stage": stage, "model.seed": seed,
                          "paradigm": "sl", "clients.count": 1, "data.dataset": dataset,
                          "data.train_limit": 1, "data.test_limit": 1, "threat.aux_split": "train",
                          "output.name": "privacy-analysis"})
    knowledge = knowledge_for_run(config)
    # Several questions share an image: draw rows until enough distinct images are in hand.
    samples = distinct_images(RunData.build(config).auxiliary(8 * images))[:images]
    if len(samples) < images:
        raise UsageError(f"--images {images}: {dataset} has only {len(samples)} training images")
    return knowledge, samples


def run_positions(args: argparse.Namespace) -> Path:
    from attacks.position_probes import PositionProbeOptions, position_probes

    check_positions_arguments(args)
    options = PositionProbeOptions(test_share=args.test_share, probes=args.probes, seed=args.seed)
    out = Path(args.out or f"positions-{args.profile}-{args.stage}")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    knowledge, samples = attacker_view(args.profile, args.stage, args.dataset, args.images, seed=args.seed)
    places = position_probes(knowledge, samples, options, progress=not args.no_progress)
    # The last vision place is the feature layer LLaVA reads (vlm.segments.vision_hidden_states).
    feature_layer = max(p.layer for p in places if p.kind == "vision")
    meta = {"profile": args.profile, "stage": args.stage, "dataset": args.dataset, "images": len(samples),
            "num_patches": knowledge.num_patches, "first_cut": knowledge.first_cut,
            "feature_layer": feature_layer, "options": asdict(options), "seconds": time.perf_counter() - start}
    out.mkdir(parents=True, exist_ok=True)
    (out / "positions.json").write_text(json.dumps({**meta, "places": [p.to_dict() for p in places]}, indent=2))
    (out / "positions.md").write_text(positions_report(places, meta))
    positions_plot(places, meta, out / "positions.png")
    return out


@dataclass
class PositionlessPrepare:
    """What a positionless edge is prepared from: the model, the training rows and the distillation."""

    profile: str = "mini"
    stage: str = "vqa"
    # Whose training rows the edge is distilled on: the data the profile's model reads.
    dataset: str = "easyvqa"
    rows: int = 512
    held_out: int = 64
    distill: Any = None  # privacy.positionless.DistillSettings (None: its defaults)

    def __post_init__(self) -> None:
        from privacy.base import OptionError
        from privacy.positionless import DistillSettings

        self.distill = self.distill or DistillSettings()
        if self.profile not in profile_names():
            raise UsageError(f"profile {self.profile!r}: allowed {', '.join(profile_names())}")
        if self.stage not in STAGES:
            raise UsageError(f"stage {self.stage!r}: allowed {', '.join(STAGES)}")
        if self.rows < 1 or self.held_out < 1:
            raise UsageError(f"rows {self.rows}, held_out {self.held_out}: each must be at least 1")
        try:
            self.distill.validate(get_profile(self.profile).vision_blocks)
        except OptionError as error:
            raise UsageError(f"{error.option} {error.value!r}: allowed {error.allowed}") from None

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> "PositionlessPrepare":
        """From one flat table (a sweep's [positionless.LABEL]): these fields and DistillSettings'."""
        from dataclasses import fields

        from privacy.positionless import DistillSettings

        own = {"profile", "stage", "dataset", "rows", "held_out"}
        allowed = own | {f.name for f in fields(DistillSettings)}
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise UsageError(f"{unknown[0]}: not a setting of the positionless edge; allowed: {', '.join(sorted(allowed))}")
        return cls(**{k: v for k, v in table.items() if k in own},
                   distill=DistillSettings(**{k: v for k, v in table.items() if k not in own}))


def prepare_positionless(out: Path, edge: PositionlessPrepare, *, stages: Path | None = None,
                         progress: bool = True) -> dict[str, Any]:
    """Prepare the edge into `out`, resuming at the first block not cached under `stages` (default
    out/stages; edges that share it share their blocks); returns its report."""
    from tqdm.auto import tqdm

    from privacy.positionless import (
        MANIFEST_FILE, TOWER_FILE, DistillBatch, distill_block, held_out_kl, positionless_tower, settings_fingerprint,
    )
    from vlm.segments import llava_parts

    settings = edge.distill
    start = time.perf_counter()
    front = load_front(edge.profile, edge.stage, edge.rows + edge.held_out, seed=settings.seed, dataset=edge.dataset)
    k, model = front.knowledge, front.knowledge.model
    if len(front.rows) < edge.rows + edge.held_out:
        raise UsageError(f"rows {edge.rows} + held_out {edge.held_out}: the dataset has {len(front.rows)} training rows")
    rows = DistillBatch(k.pixel_values(front.rows), [k.prompt_ids(s.question) for s in front.rows],
                        [k.answer_ids(s.answer) for s in front.rows])
    train = rows.take(torch.arange(edge.rows))
    held_out = rows.take(torch.arange(edge.rows, edge.rows + edge.held_out))
    fingerprint = settings_fingerprint(settings, edge.profile, edge.stage, edge.rows, edge.dataset)
    out.mkdir(parents=True, exist_ok=True)
    stages = (out / "stages" if stages is None else stages) / fingerprint
    stages.mkdir(parents=True, exist_ok=True)
    tower = positionless_tower(llava_parts(model).vision_tower).requires_grad_(False)
    report = {"profile": edge.profile, "stage": edge.stage, "settings": asdict(settings), "training_rows": edge.rows,
              "held_out": edge.held_out, "fingerprint": fingerprint,
              "kl_positionless": held_out_kl(model, tower, held_out, settings.temperature), "blocks": []}
    for block in range(1, settings.blocks + 1):
        saved = stages / f"block-{block}.pt"
        if saved.exists():
            stage = torch.load(saved, weights_only=True)
            tower.load_state_dict(stage["tower"])
            report["blocks"].append(stage["metrics"])
            continue
        bar = tqdm(total=settings.steps, desc=f"distil block {block}", disable=not progress)
        metrics = distill_block(model, tower, block, train, settings,
                                progress=lambda m: (bar.update(), bar.set_postfix(m, refresh=False)))
        bar.close()
        metrics = {"block": block, **{f"last_{key}" if key != "position_accuracy" else key: value
                                      for key, value in metrics.items()},
                   "kl_held_out": held_out_kl(model, tower, held_out, settings.temperature)}
        # Written whole, then renamed: a killed run leaves no torn stage behind.
        torch.save({"tower": tower.state_dict(), "metrics": metrics}, saved.with_suffix(".tmp"))
        saved.with_suffix(".tmp").replace(saved)
        report["blocks"].append(metrics)
    torch.save(tower.state_dict(), out / TOWER_FILE)
    report["seconds"] = time.perf_counter() - start
    (out / "positionless.json").write_text(json.dumps(report, indent=2))
    (out / "positionless.md").write_text(positionless_report(report))
    # The manifest last: a folder with one holds a whole edge.
    (out / MANIFEST_FILE).write_text(json.dumps({"profile": edge.profile, "stage": edge.stage,
                                                 "num_patches": get_profile(edge.profile).num_patches,
                                                 "fingerprint": fingerprint, "settings": asdict(settings)}, indent=2))
    return report


def run_positionless(args: argparse.Namespace) -> Path:
    from privacy.positionless import DistillSettings

    edge = PositionlessPrepare(
        profile=args.profile, stage=args.stage, dataset=args.dataset, rows=args.rows, held_out=args.held_out,
        distill=DistillSettings(blocks=args.blocks, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                temperature=args.temperature, position_weight=args.position_weight, seed=args.seed))
    torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    stages = Path(args.stages).expanduser() if args.stages else None
    prepare_positionless(out, edge, stages=stages, progress=not args.no_progress)
    return out


def positionless_report(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"# Positionless edge: {report['profile']} ({report['stage']})", "",
             f"Blocks 1..{s['blocks']}, {s['steps']} steps each of {s['batch_size']} rows ({report['training_rows']} training "
             f"rows), lr {s['lr']}, T = {s['temperature']}, λ_pos = {s['position_weight']}; KL to the original "
             f"model on {report['held_out']} held-out rows (T²·KL at T, the distillation loss).", "",
             "| edge | held-out KL | position predictor accuracy |", "| --- | --- | --- |",
             f"| positional embeddings removed | {report['kl_positionless']:.4g} | |"]
    for block in report["blocks"]:
        accuracy = f"{block['position_accuracy']:.1%}" if "position_accuracy" in block else ""
        lines.append(f"| + block {block['block']} distilled | {block['kl_held_out']:.4g} | {accuracy} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qpriv-privacy", description=__doc__.splitlines()[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    paf = commands.add_parser("paf", help="PAF and max-PAF of each sub-layer in front of a cut")
    paf.add_argument("--profile", default="mini", choices=profile_names())
    paf.add_argument("--stage", default="base", choices=STAGES,
                     help="the weights (tiny always has random ones; llava-1.5-7b its checkpoint)")
    paf.add_argument("--cut", type=int, help="analyse decoder layers [0, cut) (default: the profile's SL cut)")
    paf.add_argument("--samples", type=int, default=16, help="easy-VQA training rows whose inputs are used")
    paf.add_argument("--directions", type=int, default=100, help="Monte-Carlo directions δ per Jacobian")
    paf.add_argument("--tokens", type=int, default=8, help="tokens drawn per sample (0: all)")
    paf.add_argument("--tokens-from", choices=TOKEN_SETS, default="all",
                     help="draw them among all non-padded tokens, the text's only, or the visual rows' only")
    paf.add_argument("--theta", choices=THETAS, default="pullback", help="the angle θ_i's reading (privacy/paf.py)")
    paf.add_argument("--sigma", choices=SIGMAS, default="eig", help="σ_i: eigenvalues of JᵀJ, or singular values")
    paf.add_argument("--reduce", choices=REDUCES, default="sum", help="Σ|terms| (the paper) or their 2-norm")
    paf.add_argument("--no-attention", action="store_true", help="leave out the attention block as a whole")
    paf.add_argument("--seed", type=int, default=0, help="token draw, Monte-Carlo directions and the LoRA seed")
    paf.add_argument("--out", help="the report folder (default ./paf-<profile>-<stage>-cut<N>)")
    paf.add_argument("--threads", type=int, default=1,
                     help="torch threads (default 1: its matrices are small, and threads only contend)")
    paf.add_argument("--no-progress", action="store_true", help="no progress bar")
    positions = commands.add_parser("positions", help="probe each visual row's patch position, layer by layer")
    positions.add_argument("--profile", default="mini", choices=profile_names())
    positions.add_argument("--stage", default="base", choices=STAGES,
                           help="the weights (tiny always has random ones; llava-1.5-7b its checkpoint)")
    positions.add_argument("--dataset", default="easyvqa-stamped", help="whose training images are probed")
    positions.add_argument("--images", type=int, default=512, help="distinct training images")
    positions.add_argument("--test-share", type=float, default=0.25, help="share of the images held out to score")
    positions.add_argument("--probes", default="linear,mlp", help="comma-separated: linear, mlp")
    positions.add_argument("--seed", type=int, default=0, help="image split, shuffles and the MLP's initialisation")
    positions.add_argument("--out", help="the report folder (default ./positions-<profile>-<stage>)")
    positions.add_argument("--threads", type=int, default=1, help="torch threads")
    positions.add_argument("--no-progress", action="store_true", help="no progress bar")
    positionless = commands.add_parser("positionless", help="distil a vision tower without positional embeddings")
    positionless.add_argument("--profile", default="mini", choices=profile_names())
    positionless.add_argument("--stage", default="vqa", choices=STAGES, help="the teacher's (and the edge's) weights")
    positionless.add_argument("--dataset", default="easyvqa", help="whose training rows the edge is distilled on")
    positionless.add_argument("--blocks", type=int, default=1, help="k: vision blocks distilled, from the first")
    positionless.add_argument("--steps", type=int, default=200, help="Adam steps per block")
    positionless.add_argument("--batch-size", type=int, default=8)
    positionless.add_argument("--lr", type=float, default=1e-4)
    positionless.add_argument("--temperature", type=float, default=4.0)
    positionless.add_argument("--position-weight", type=float, default=0.0,
                              help="λ_pos of the adversarial variant (0: plain distillation)")
    positionless.add_argument("--rows", type=int, default=512, help="easy-VQA training rows to distil on")
    positionless.add_argument("--held-out", type=int, default=64, help="further training rows the KL is scored on")
    positionless.add_argument("--seed", type=int, default=0)
    positionless.add_argument("--out", required=True, help="the artefact folder")
    positionless.add_argument("--stages", help="where each block's result is cached (default DIR/stages); "
                                               "edges prepared with one folder share the blocks they have in common")
    positionless.add_argument("--threads", type=int, default=1, help="torch threads")
    positionless.add_argument("--no-progress", action="store_true", help="no progress bar")
    mtv = mtv_command.add_command(commands)
    args = parser.parse_args(argv)
    command, run, name = {"paf": (paf, run_paf, "paf"), "positions": (positions, run_positions, "positions"),
                          "positionless": (positionless, run_positionless, "positionless"),
                          "mtv": (mtv, mtv_command.run_mtv, mtv_command.NAME)}[args.command]
    try:
        out = run(args)
    except UsageError as error:
        command.error(str(error))
    except Exception as error:  # a model that cannot be loaded: say why, without a traceback
        from vlm.loading import ModelNotAvailableError

        if not isinstance(error, ModelNotAvailableError):
            raise
        print(f"qpriv-privacy: {error}", file=sys.stderr)
        return 2
    written = f"{name}.json, {TOWER_FILE_NAMES}" if name == "positionless" else f"{name}.json, {name}.png"
    print(f"{args.command} report: {out / f'{name}.md'} (and {written})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
