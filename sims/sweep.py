"""Sweeps: one file names many runs and the attacks replayed on each; runs resume, results stay.

    qpriv-sweep run sims/sweeps/paradigms.toml [--runner flwr|inprocess] [--out DIR] [--allow-dirty]
    qpriv-sweep status sims/sweeps/paradigms.toml [--out DIR] [--points 'paradigms-*']
    python -m sims.sweep run sims/sweeps/smoke.toml          # the same CLI

A sweep file (TOML, or YAML; read with omegaconf) has these tables:

    [sweep]    sim = "sims/usl_easyvqa"  the app whose declared config every point starts from
               runner = "flwr"           or "inprocess" (--runner overrides)
               seeds = [0, 1, 2]         optional: every point runs at each seed (model.seed,
                                         data.seed and privacy.seed set to it; run names end in
                                         -s<seed>), what a paired verdict needs (analysis.stats)
    [fixed]    run-config overrides for every point ("model.profile" = "mini", ...)
    [dtp]      optional: pruning.prepare.PrepareSettings fields; the artefacts are prepared once into
               <sweep folder>/dtp, and every pruned point that sets no pruning.artifacts uses them.
               alpha = [0, 0.5, 1] prepares one per value into <sweep folder>/dtp/alpha-<value>
               (the α sweep), and a pruned point uses the one of its own pruning.alpha
    [positionless.LABEL]  optional: a positionless edge (sims.privacy_cli.PositionlessPrepare
               fields: profile, stage, rows, held_out, and privacy.positionless.DistillSettings'),
               prepared once into <sweep folder>/positionless/LABEL (the edges share their
               blocks' cache); a point whose privacy.positionless.artifact is LABEL runs it
    [[grid]]   one part of the sweep (parts are concatenated), each with
               name     a label, the start of its points' run names
               fixed    overrides for this part's points
               product  key -> list of values; every combination is a point
               [[grid.zip]]  keys -> lists of one length, varied together as one axis ("label", if
                        given, names the axis values in run names instead of the values)
    [attacks.LABEL]  replayed on every finished run it applies to, its result saved under LABEL:
               attack   the registered attack to replay (default: LABEL itself), so one attack can
                        replay several times with other options beside itself, e.g.
                        [attacks.actinv_masked] attack = "actinv", options = { mask_zeros = true }
               options  the attack's options (`python -m attacks list`)
               where    run-config key -> list of values a run must have (e.g. "threat.model")
               round    replay on that round's transfers only (the runs list it in
                        threat.record_rounds), so one attack reads several points of training
                        under labels of their own
               aux_limit  the auxiliary rows it fits on (default: the run's threat.aux_limit)

Every point's config is validated, and every existing run folder compared with its point,
before the first run starts: a bad key or value names the point and the key, a point whose
config changed since its run folder was written is refused naming the changed keys. The
sweep folder (default ~/qpriv-sweeps/<file stem>) holds `runs/<point>/` (ordinary run
folders, which `python -m attacks` and the results notebook read), `points/<point>.json`
(each point's overrides, failures, seconds per run and attack, and the attack and options its
results were made with, keyed by label) and `sweep.json` (each start's points and provenance:
commit, seeds, models' weights, machine and its load); a label's result is
`runs/<point>/attacks/<LABEL>.json` (its "attack" field the label, details.base_attack the
registered attack) and `<LABEL>.safetensors`. A failed run or attack is recorded with its
reason and the sweep goes on; running the same command again skips finished runs and attack
results, resumes an interrupted run and retries failures. A start is refused while the working
tree's code differs from its commit (the error names the changed paths) unless `--allow-dirty`,
which marks the start dirty. Attacks whose fit reads only public data (all but FSHA) are fitted
once per label and public setting and replayed on every run of it. With `--archive DIR` each
point's results are also copied into DIR as they are made, and a new machine restores from DIR
what it lacks (sims/archive.py).
"""

import argparse
import fnmatch
import itertools
import json
import logging
import re
import shutil
import sys
import time
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from analysis.provenance import DirtyTree, of_runs, provenance
from attacks.base import Attack, AttackOptionError, attack_class, available_attacks, checked_options
from attacks.context import ATTACK_FOLDER
from attacks.replay import check_replays_by_round, fit_for_run, public_setting, replay
from config import ConfigError, SimConfig, load_config
from config.schema import PruningConfig
from pruning import DTP_FILE, ORACLE_FILE
from privacy import parse_defense_names
from privacy.positionless import MANIFEST_FILE
from pruning.prepare import PrepareSettings, prepare_dtp
from sims import archive as A
from sims.inprocess import run_in_process
from sims.launch import LocalSuperLink, app_config, launch
from sims.privacy_cli import PositionlessPrepare, prepare_positionless
from sims.usage import UsageError
from strategies.callbacks import changed_since_written, is_stale, write_json_atomically, written_differences
from training.protocol import SWEEP_STAMP

RUNNERS = ("flwr", "inprocess")
SECTIONS = ("sweep", "fixed", "dtp", "positionless", "grid", "attacks")
EDGE_ARTIFACT = "privacy.positionless.artifact"
SWEEP_KEYS = ("sim", "runner", "seeds")
# What a sweep's seeds axis sets for each seed: every seed a run draws from.
SEED_KEYS = ("model.seed", "data.seed", "privacy.seed")
GRID_KEYS = ("name", "fixed", "product", "zip")
ATTACK_KEYS = ("attack", "options", "where", "round", "aux_limit")
# A label names files in the run's attacks folder.
ATTACK_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
LABEL = "label"
NO_PRUNING = "off"

logger = logging.getLogger(__name__)


class SweepError(ValueError):
    """A sweep file or sweep folder that cannot run; the message names the point and the key."""


@dataclass(frozen=True)
class AttackPlan:
    """One [attacks.LABEL] table: `name` is the label its results are saved and found under,
    `attack` the registered attack it replays."""

    name: str
    options: dict[str, Any]
    where: dict[str, list[Any]]
    attack: str = ""
    # The round whose transfers it reads (None: every stored transfer).
    round: int | None = None
    # Auxiliary (public) rows it fits on (None: the run's threat.aux_limit).
    aux_limit: int | None = None

    def __post_init__(self) -> None:
        if not self.attack:
            object.__setattr__(self, "attack", self.name)

    def applies_to(self, config: Mapping[str, Any]) -> bool:
        return all(config.get(key) in values for key, values in self.where.items())


@dataclass
class Point:
    """One run of the sweep: its name, its overrides of the app's config and its resolved config."""

    name: str
    part: str
    overrides: dict[str, Any]
    config: SimConfig = field(repr=False)

    @property
    def folder(self) -> Path:
        return self.config.run_folder()


@dataclass
class Sweep:
    file: Path
    sim: Path
    runner: str
    folder: Path
    points: list[Point]
    attacks: list[AttackPlan]
    # DTP's artefacts to prepare, by folder (one, or one per alpha of [dtp]'s list).
    dtp: dict[Path, PrepareSettings]
    # Positionless edges to prepare, by label (their folders: edge_folder(label)).
    edges: dict[str, PositionlessPrepare] = field(default_factory=dict)
    # Where each point's results are archived as they are made, and restored from (sims/archive.py).
    archive: Path | None = None

    def edge_folder(self, label: str) -> Path:
        return self.folder / "positionless" / label

    def point_record(self, point: Point) -> Path:
        return self.folder / "points" / f"{point.name}.json"


# --- reading a sweep file ---------------------------------------------------------------------


def read_sweep_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"no sweep file at {path}")
    if path.suffix == ".toml":
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise SweepError(f"{path}: not valid TOML ({error})") from None
        tree = OmegaConf.create(raw)
    elif path.suffix in (".yaml", ".yml"):
        tree = OmegaConf.load(path)
    else:
        raise SweepError(f"{path}: a sweep file is .toml, .yaml or .yml")
    return OmegaConf.to_container(tree, resolve=True)


def _unknown(where: str, found: Mapping[str, Any], allowed: Sequence[str]) -> None:
    unknown = sorted(set(found) - set(allowed))
    if unknown:
        raise SweepError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(allowed)}")


def _table(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SweepError(f"{where}: must be a table, got {value!r}")
    return dict(value)


def _values(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise SweepError(f"{where}: must be a non-empty list of values, got {value!r}")
    return value


def _slug(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def _axes(part: str, grid: Mapping[str, Any]) -> list[list[tuple[dict[str, Any], str]]]:
    """Each axis as its list of (overrides, name fragment) choices."""
    axes = []
    for key, values in _table(f"grid {part!r}: product", grid.get("product")).items():
        axes.append([({key: v}, _slug(v)) for v in _values(f"grid {part!r}: product.{key}", values)])
    zips = grid.get("zip") or []
    if not isinstance(zips, list):
        raise SweepError(f"grid {part!r}: zip must be a list of tables ([[grid.zip]])")
    for index, group in enumerate(zips):
        group = _table(f"grid {part!r}: zip[{index}]", group)
        lists = {key: _values(f"grid {part!r}: zip[{index}].{key}", v) for key, v in group.items()}
        lengths = {key: len(v) for key, v in lists.items()}
        if not lists or len(set(lengths.values())) != 1:
            raise SweepError(f"grid {part!r}: zip[{index}] needs lists of one length, got {lengths}")
        labels = lists.pop(LABEL, None)
        choices = []
        for i in range(next(iter(lengths.values()))):
            overrides = {key: values[i] for key, values in lists.items()}
            name = _slug(labels[i]) if labels else "-".join(_slug(v) for v in overrides.values())
            choices.append((overrides, name))
        axes.append(choices)
    if not axes:
        raise SweepError(f"grid {part!r}: empty grid (no product or zip axes); one run is `python -m sims.launch`")
    return axes


def _seeds(value: Any) -> list[int]:
    """sweep.seeds: distinct non-negative integers (none: each point runs once, at its config's seeds)."""
    if value is None:
        return []
    allowed = "a list of distinct non-negative integers, e.g. [0, 1, 2]"
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                             for s in value):
        raise SweepError(f"sweep.seeds: {value!r}; allowed: {allowed}")
    if len(set(value)) != len(value):
        raise SweepError(f"sweep.seeds: {value!r} repeats a seed; allowed: {allowed}")
    return list(value)


def _attack_plans(raw: Mapping[str, Any], known_keys: set[str]) -> list[AttackPlan]:
    plans = []
    for name, spec in _table("attacks", raw).items():
        spec = _table(f"attacks.{name}", spec)
        _unknown(f"attacks.{name}", spec, ATTACK_KEYS)
        attack = spec.get("attack", name)
        if not isinstance(attack, str) or attack not in available_attacks():
            what = "no such attack" if "attack" not in spec else f"attack = {attack!r}: no such attack"
            raise SweepError(f"attacks.{name}: {what}; registered: {', '.join(available_attacks())}")
        if not ATTACK_LABEL.fullmatch(name):
            raise SweepError(f"attacks.{name}: a label is letters, digits, '_', '.' and '-' (it names the "
                             "result's files)")
        if name in available_attacks() and attack != name:
            raise SweepError(f"attacks.{name}: the label names the attack {name!r} but replays {attack!r}; "
                             "give this table a label of its own")
        options = _table(f"attacks.{name}.options", spec.get("options"))
        try:
            checked_options(attack, attack_class(attack).Options, options)
        except AttackOptionError as error:
            raise SweepError(f"attacks.{name}.options: {error}") from None
        where = {}
        for key, values in _table(f"attacks.{name}.where", spec.get("where")).items():
            if key not in known_keys:
                raise SweepError(f"attacks.{name}.where: unknown run-config key {key!r}")
            where[key] = _values(f"attacks.{name}.where.{key}", values)
        round_ = spec.get("round")
        if round_ is not None:
            if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 1:
                raise SweepError(f"attacks.{name}.round: {round_!r}; allowed: a round number >= 1")
            try:
                check_replays_by_round(attack)
            except ValueError as error:
                raise SweepError(f"attacks.{name}.round: {error}") from None
        aux_limit = spec.get("aux_limit")
        if aux_limit is not None and (isinstance(aux_limit, bool) or not isinstance(aux_limit, int) or aux_limit < 1):
            raise SweepError(f"attacks.{name}.aux_limit: {aux_limit!r}; allowed: a number of auxiliary rows >= 1")
        plans.append(AttackPlan(name, options, where, attack, round_, aux_limit))
    return plans


def load_sweep(path: str | Path, *, runner: str | None = None, out: str | Path | None = None,
               overrides: Mapping[str, Any] | None = None) -> Sweep:
    """The sweep a file describes, every point validated; raises SweepError before any run.
    `overrides` are run-config keys set on every point over what the file gives it (a benchmark
    running the file's points at another seed, in a folder of their own)."""
    path = Path(path)
    raw = read_sweep_file(path)
    _unknown(str(path), raw, SECTIONS)
    head = _table("sweep", raw.get("sweep"))
    _unknown("sweep", head, SWEEP_KEYS)
    if "sim" not in head:
        raise SweepError("sweep.sim: missing; the app folder whose config the points start from, e.g. \"sims/usl_easyvqa\"")
    # A relative sim is found from the working folder, else from the sweep file's folder upwards.
    candidates = [Path(head["sim"]), *(parent / head["sim"] for parent in path.resolve().parents)]
    sim = next((c for c in candidates if (c / "pyproject.toml").is_file()), candidates[0])
    if not (sim / "pyproject.toml").is_file():
        raise SweepError(f"sweep.sim: {head['sim']!r} is not a Flower App folder (no pyproject.toml)")
    runner = runner or head.get("runner", "flwr")
    if runner not in RUNNERS:
        raise SweepError(f"sweep.runner: {runner!r}; allowed: {', '.join(RUNNERS)}")
    folder = Path(out).expanduser() if out else Path.home() / "qpriv-sweeps" / path.stem
    dtp = _dtp_preparations(folder, raw.get("dtp"))
    edges = {}
    for label, table in _table("positionless", raw.get("positionless")).items():
        if label == "stages":
            raise SweepError("positionless.stages: that label names the edges' shared block cache; choose another")
        try:
            edges[str(label)] = PositionlessPrepare.from_table(dict(_table(f"positionless.{label}", table)))
        except UsageError as error:
            raise SweepError(f"positionless.{label}: {error}") from None
    waiting = _artifact_folders(folder, edges, dtp)
    seeds = _seeds(head.get("seeds"))
    fixed = _table("fixed", raw.get("fixed"))
    grids = raw.get("grid")
    if not grids:
        raise SweepError(f"{path}: empty grid: no [[grid]] tables")
    if not isinstance(grids, list):
        raise SweepError(f"{path}: grid must be a list of tables ([[grid]])")
    points: list[Point] = []
    for index, grid in enumerate(grids):
        grid = _table(f"grid[{index}]", grid)
        part = str(grid.get("name", f"part{index}"))
        _unknown(f"grid {part!r}", grid, GRID_KEYS)
        part_fixed = _table(f"grid {part!r}: fixed", grid.get("fixed"))
        for combination, seed in itertools.product(itertools.product(*_axes(part, grid)), seeds or [None]):
            varied = {k: v for axis, _ in combination for k, v in axis.items()}
            name = "-".join([_slug(part), *(fragment for _, fragment in combination),
                             *([] if seed is None else [f"s{seed}"])])
            point_overrides = {**fixed, **part_fixed, **varied, **(overrides or {})}
            if seed is not None:
                fixing = sorted(set(point_overrides) & set(SEED_KEYS))
                if fixing:
                    raise SweepError(f"grid {part!r}: {fixing} set while sweep.seeds sets every seed of a run; "
                                     "drop one of them")
                point_overrides.update(dict.fromkeys(SEED_KEYS, seed))
            point_overrides.update({"output.root": str(folder / "runs"), "output.name": name})
            if dtp and point_overrides.get("pruning.policy", NO_PRUNING) != NO_PRUNING:
                point_overrides.setdefault("pruning.artifacts", str(_dtp_for(name, dtp, point_overrides)))
            if point_overrides.get(EDGE_ARTIFACT) in edges:
                point_overrides[EDGE_ARTIFACT] = str(folder / "positionless" / point_overrides[EDGE_ARTIFACT])
            points.append(Point(name, part, point_overrides, _point_config(name, sim, point_overrides, waiting)))
    names = [p.name for p in points]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise SweepError(f"points share a run name: {duplicated}; give the parts distinct names or the zip axes labels")
    attacks = _attack_plans(raw.get("attacks"), set(points[0].config.to_flat()))
    for plan in attacks:
        for point in points:
            rounds = point.config.recorded_rounds
            if plan.round is not None and plan.applies_to(point.config.to_flat()) and plan.round not in (rounds or ()):
                raise SweepError(f"point {point.name}: attacks.{plan.name}.round = {plan.round}, which its run does "
                                 f"not store (threat.record_rounds = {point.config.threat.record_rounds!r}); list it "
                                 "there")
    sweep = Sweep(path, sim, runner, folder, points, attacks, dtp, edges)
    _check_existing(sweep)
    return sweep


def _point_config(name: str, sim: Path, overrides: dict[str, Any], waiting: set[Path]) -> SimConfig:
    """The point's validated config. Until the sweep has prepared the artefacts in `waiting` (DTP's,
    the positionless edges'), a point using one is checked on every other key (with pruning off,
    without the positionless edge), and again in full once they exist."""
    checked = dict(overrides)
    for _ in range(3):
        try:
            return load_config(app_config(sim, checked))
        except ConfigError as error:
            if Path(str(error.value)) not in waiting:
                raise SweepError(f"point {name}: {error}") from None
            if error.key == "pruning.artifacts":
                checked.update({"pruning.policy": NO_PRUNING, "pruning.ratio": 0.0})
            elif error.key == EDGE_ARTIFACT:
                names = parse_defense_names(str(checked.get("privacy.defenses", "")))
                checked.update({"privacy.defenses": ",".join(n for n in names if n != "positionless"),
                                EDGE_ARTIFACT: ""})
            else:
                raise SweepError(f"point {name}: {error}") from None
    raise SweepError(f"point {name}: its config could not be checked")


def _check_existing(sweep: Sweep) -> None:
    """Refuse points whose run folders or attack results were made with other settings."""
    for point in sweep.points:
        changed = changed_since_written(point.config, point.folder)
        if changed:
            raise SweepError(
                f"point {point.name}: its run folder {point.folder} was written with another value of "
                f"{', '.join(changed)}; restore the sweep file or remove that run folder"
            )
        record = read_record(sweep, point)
        for plan in sweep.attacks:
            made = record.get("attacks", {}).get(plan.name, {})
            replayed = made.get("attack", plan.name)
            if made and replayed != plan.attack:
                raise SweepError(
                    f"point {point.name}: its {plan.name} result was made with attack {replayed!r}, the file's "
                    f"attacks.{plan.name} replays {plan.attack!r}; restore it or delete "
                    f"{point.folder / ATTACK_FOLDER / plan.name}.json"
                )
            if made and made.get("aux_limit") != plan.aux_limit:
                raise SweepError(
                    f"point {point.name}: its {plan.name} result was fitted on aux_limit = {made.get('aux_limit')}, the "
                    f"file's attacks.{plan.name} on {plan.aux_limit}; restore it or delete "
                    f"{point.folder / ATTACK_FOLDER / plan.name}.json"
                )
            made_with = made.get("options")
            if made_with is not None and made_with != plan.options:
                keys = sorted(k for k in set(made_with) | set(plan.options) if made_with.get(k) != plan.options.get(k))
                raise SweepError(
                    f"point {point.name}: its {plan.name} result was made with other attacks.{plan.name}.options "
                    f"({', '.join(keys)}); restore them or delete {point.folder / ATTACK_FOLDER / plan.name}.json"
                )


# --- a point's state on disk ------------------------------------------------------------------


def read_record(sweep: Sweep, point: Point) -> dict[str, Any]:
    path = sweep.point_record(point)
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        # Written atomically, so torn only by damage; the run folder keeps the point's results and
        # the sweep writes the record anew.
        logger.warning("point %s: its record %s is torn (%s); started afresh", point.name, path, error.msg)
        return {}


def _write_record(sweep: Sweep, point: Point, record: dict[str, Any]) -> None:
    path = sweep.point_record(point)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, record)


def run_state(point: Point) -> dict[str, Any]:
    """The run folder's status.json (state "pending" when the run never started)."""
    path = point.folder / "status.json"
    return json.loads(path.read_text()) if path.exists() else {"state": "pending"}


def attack_done(point: Point, attack: str) -> bool:
    """Whether the point holds the attack's result, whole (a torn one, from damage or an older
    build's non-atomic save, is replayed again)."""
    path = point.folder / ATTACK_FOLDER / f"{attack}.json"
    if not path.is_file():
        return False
    try:
        json.loads(path.read_text())
    except json.JSONDecodeError:
        logger.warning("point %s: its %s result %s is torn; replayed again", point.name, attack, path)
        return False
    return True


# --- running ---------------------------------------------------------------------------------


def _run_point(sweep: Sweep, point: Point) -> dict[str, Any]:
    """Run (or resume) the point with the sweep's runner; its status afterwards."""
    if sweep.runner == "inprocess":
        try:
            run_in_process(app_config(sweep.sim, point.overrides))
        except Exception as error:  # noqa: BLE001 - a failed run is recorded and the sweep goes on
            status = run_state(point)
            if status.get("state") != "failed":
                status = {"state": "failed", "error_type": type(error).__name__, "error": str(error),
                          "traceback": traceback.format_exc()[-4000:]}
            return status
        return run_state(point)
    federation = f"num-supernodes={point.config.clients.count}"
    status, _, _ = launch(sweep.sim, point.overrides, federation)
    return status


def _provenance(sweep: Sweep, allow_dirty: bool) -> dict[str, Any]:
    """The start's provenance: the commit its runs are made with, their seeds and models' weights;
    a tree whose code is not its commit's raises DirtyTree unless `allow_dirty`."""
    return provenance(allow_dirty=allow_dirty, **of_runs({**p.config.to_flat(), **p.overrides} for p in sweep.points))


def _stamp(sweep: Sweep, measured_on: Mapping[str, Any]) -> None:
    """<sweep folder>/sweep.json: the file and sim, and per start its runner, the points it was
    given and its provenance (a dirty start's marked, which the results rendered from the folder
    carry: benchmarks/sweep_results.py)."""
    path = sweep.folder / SWEEP_STAMP
    starts = json.loads(path.read_text()).get("starts", []) if path.exists() else []
    sweep.folder.mkdir(parents=True, exist_ok=True)
    # The folder and the second tell apart starts that an archive merges from several machines.
    start = {**measured_on, "runner": sweep.runner, "points": [p.name for p in sweep.points],
             "folder": str(sweep.folder), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_atomically(path, {"file": str(sweep.file), "sim": str(sweep.sim), "starts": [*starts, start]})


def _dtp_preparations(folder: Path, table: Any) -> dict[Path, PrepareSettings]:
    """[dtp]'s preparations by folder: <folder>/dtp, or with a list of alphas one per value."""
    if table is None:
        return {}
    settings = dict(_table("dtp", table))
    _unknown("dtp", settings, [f.name for f in fields(PrepareSettings)])
    alphas = settings.pop("alpha", None)
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    if not isinstance(alphas, list):
        return {folder / "dtp": PrepareSettings(**settings, **({} if alphas is None else {"alpha": alphas}))}
    if not alphas or len(set(alphas)) != len(alphas):
        raise SweepError(f"dtp.alpha: {alphas}; a number, or a list of distinct numbers (one preparation each)")
    return {folder / "dtp" / f"alpha-{float(alpha):g}": PrepareSettings(**settings, alpha=float(alpha)) for alpha in alphas}


def _dtp_for(point: str, dtp: Mapping[Path, PrepareSettings], overrides: Mapping[str, Any]) -> Path:
    """The DTP folder a pruned point reads: the only one, or the one prepared at its pruning.alpha."""
    if len(dtp) == 1:
        return next(iter(dtp))
    alpha = float(overrides.get("pruning.alpha", PruningConfig().alpha))
    for folder, settings in dtp.items():
        if settings.alpha == alpha:
            return folder
    prepared = ", ".join(f"{settings.alpha:g}" for settings in dtp.values())
    raise SweepError(f"{point}: pruning.alpha={alpha:g} has no DTP preparation; dtp.alpha prepares {prepared}")


def _artifact_folders(folder: Path, edges: Mapping[str, Any], dtp: Mapping[Path, Any]) -> set[Path]:
    """Where a sweep in `folder` prepares its artefacts: DTP's and each positionless edge's."""
    return {*dtp, *(folder / "positionless" / label for label in edges)}


def _prepare_artifacts(sweep: Sweep, log: Callable[[str], None]) -> None:
    """DTP's artefacts and the positionless edges the points use, each prepared once."""
    prepared = False
    # Finished points (restored from an archive among them) need no artefacts.
    to_run = [p for p in sweep.points if run_state(p).get("state") != "finished"]
    for dtp_folder, settings in sweep.dtp.items():
        if all((dtp_folder / f).is_file() for f in (DTP_FILE, ORACLE_FILE)):
            continue
        if any(p.overrides.get("pruning.artifacts") == str(dtp_folder) for p in to_run):
            log(f"DTP: preparing into {dtp_folder}")
            prepare_dtp(settings, dtp_folder, progress=False)
            prepared = True
    for label, edge in sweep.edges.items():
        folder = sweep.edge_folder(label)
        if (folder / MANIFEST_FILE).is_file() or not any(p.overrides.get(EDGE_ARTIFACT) == str(folder) for p in to_run):
            continue
        log(f"positionless edge {label}: preparing into {folder}")
        prepare_positionless(folder, edge, stages=sweep.folder / "positionless" / "stages", progress=False)
        prepared = True
    if prepared:
        for point in sweep.points:
            point.config = _point_config(point.name, sweep.sim, point.overrides,
                                         _artifact_folders(sweep.folder, sweep.edges, sweep.dtp))


def applicable_attacks(sweep: Sweep, point: Point) -> list[str]:
    flat = point.config.to_flat()
    return [plan.name for plan in sweep.attacks if plan.applies_to(flat)]


def restore_archived(sweep: Sweep, log: Callable[[str], None] = print) -> list[str]:
    """Copy into the sweep folder every point that the archive holds complete (its run finished,
    every applicable attack's result) and the sweep folder has not started; a point archived
    with other settings than the file's now is left to run again. Returns the restored points."""
    if sweep.archive is None:
        return []
    A.merge_stamp(sweep.archive, sweep.folder)
    restored = []
    for point in sweep.points:
        if run_state(point).get("state") != "pending" or not A.restorable(
                sweep.archive, point.name, applicable_attacks(sweep, point)):
            continue
        A.restore_point(sweep.archive, point.name, sweep.folder)
        # Against the point's overrides, not its config: one whose artefacts (DTP's, an edge's)
        # are not prepared yet was validated without them.
        changed = written_differences({**point.config.to_flat(), **point.overrides}, point.folder)
        if changed:
            shutil.rmtree(point.folder)
            sweep.point_record(point).unlink(missing_ok=True)
            log(f"{point.name}: not restored from {sweep.archive}: archived with another value of "
                f"{', '.join(changed)}; it runs again")
            continue
        restored.append(point.name)
    return restored


def _save(sweep: Sweep, point: Point, record: dict[str, Any]) -> None:
    """The point's record, and with an archive, its results so far (once its run finished)."""
    _write_record(sweep, point, record)
    if sweep.archive is not None and run_state(point).get("state") == "finished":
        A.archive_point(sweep.folder, point.name, sweep.archive)


def run_sweep(
    sweep: Sweep, *, allow_dirty: bool = False, progress: bool = True, log: Callable[[str], None] = print
) -> dict[str, str]:
    """Run every point and replay its attacks; returns each point's final state. A working tree whose
    code is not its commit's raises DirtyTree before anything is written, unless `allow_dirty`."""
    measured_on = _provenance(sweep, allow_dirty)
    restored = restore_archived(sweep, log)
    if restored:
        log(f"restored {len(restored)} point(s) from {sweep.archive}")
    _stamp(sweep, measured_on)
    _prepare_artifacts(sweep, log)
    # One local SuperLink serves every point's `flwr run`; the sweep stops it when it ends.
    with LocalSuperLink() if sweep.runner == "flwr" else nullcontext() as superlink:
        states = _run_points(sweep, progress, log)
    notice = superlink.notice() if superlink is not None else None
    if notice:
        log(notice)
    return states


def _run_points(sweep: Sweep, progress: bool, log: Callable[[str], None]) -> dict[str, str]:
    fitted: dict[tuple[str, str], Attack] = {}
    states = {}
    bar = tqdm(sweep.points, desc=f"sweep {sweep.file.stem}", unit="run", disable=not progress)
    for point in bar:
        record = read_record(sweep, point) or {}
        record.update(part=point.part, overrides=point.overrides)
        if run_state(point).get("state") != "finished":
            bar.set_postfix_str(f"{point.name}: running")
            started = time.perf_counter()
            status = _run_point(sweep, point)
            record["run"] = {k: status.get(k) for k in ("state", "error_type", "error") if k in status}
            record["run"]["seconds"] = time.perf_counter() - started
            _save(sweep, point, record)
            if status.get("state") != "finished":
                log(f"{point.name}: run {status.get('state')}: {_reason(status)}")
                states[point.name] = "failed"
                continue
        record["run"] = {**record.get("run", {}), "state": "finished"}
        for stale in ("error", "error_type"):
            record["run"].pop(stale, None)
        flat = point.config.to_flat()
        attacks = record.setdefault("attacks", {})
        for plan in sweep.attacks:
            if not plan.applies_to(flat) or attack_done(point, plan.name):
                continue
            bar.set_postfix_str(f"{point.name}: {plan.name}")
            options = {"progress": False, **plan.options} if "progress" in {
                f.name for f in fields(attack_class(plan.attack).Options)} else dict(plan.options)
            started = time.perf_counter()
            made = {"attack": plan.attack, "options": plan.options, "aux_limit": plan.aux_limit}
            try:
                if attack_class(plan.attack).fit_reads_run:
                    _replay_as(plan, point, plan.attack, options)
                else:
                    # Fitted once per label (its own options) and public setting (with the run's
                    # defenses only for an attack that fits to them).
                    adapts = attack_class(plan.attack).fit_adapts_to_defenses(plan.options)
                    key = (plan.name, public_setting(point.config, defenses=adapts))
                    if key not in fitted:
                        fitted[key] = fit_for_run(point.folder, plan.attack, options=options, aux_limit=plan.aux_limit)
                    _replay_as(plan, point, fitted[key])
                attacks[plan.name] = {"state": "finished", **made, "seconds": time.perf_counter() - started}
            except Exception as error:  # noqa: BLE001 - a failed attack is recorded and the sweep goes on
                attacks[plan.name] = {"state": "failed", **made, "error_type": type(error).__name__,
                                      "error": str(error), "traceback": traceback.format_exc()[-4000:]}
                log(f"{point.name}: {plan.name} failed: {type(error).__name__}: {error}")
            _save(sweep, point, record)
        _save(sweep, point, record)
        failed = [name for name, a in attacks.items() if a.get("state") == "failed"]
        states[point.name] = "attacks failed" if failed else "finished"
    return states


def _replay_as(plan: AttackPlan, point: Point, attack: str | Attack, options: Mapping[str, Any] | None = None) -> None:
    """Replay `attack` on the point's run and save its result under the plan's label
    (`<run>/attacks/<label>.json`, "attack" the label, details.base_attack the registered attack)."""
    result = replay(point.folder, attack, options=options, save=False, round_=plan.round, aux_limit=plan.aux_limit)
    result.attack = plan.name
    result.details.update(base_attack=plan.attack, options=plan.options)
    result.save(point.folder / ATTACK_FOLDER)


def status_rows(sweep: Sweep) -> list[dict[str, Any]]:
    """Per point: the run's state and rounds, the attacks done, failed and still to run."""
    rows = []
    for point in sweep.points:
        status, record = run_state(point), read_record(sweep, point)
        applicable = applicable_attacks(sweep, point)
        failed = [a for a in applicable
                  if record.get("attacks", {}).get(a, {}).get("state") == "failed" and not attack_done(point, a)]
        done = status.get("rounds") if status.get("state") == "finished" else status.get("round", 0)
        rows.append({
            "point": point.name,
            "run": f"{status.get('state')} (no heartbeat: its process died)" if is_stale(status) else status.get("state"),
            "round": f"{done}/{point.config.train.rounds}",
            "attacks done": ",".join(a for a in applicable if attack_done(point, a)) or "-",
            "failed": ",".join(failed) or "-",
            "to run": ",".join(a for a in applicable if not attack_done(point, a) and a not in failed) or "-",
            "reason": (_reason(status if status.get("error") else record.get("run", {})) or _unprepared(point))[:200],
        })
    return rows


def _unprepared(point: Point) -> str:
    """Which of a point's artefacts are still to prepare: until then its config (and so its attacks
    listed) is the one checked without them (_point_config)."""
    flat = point.config.to_flat()
    waiting = {"pruning.policy": "DTP's artefacts", EDGE_ARTIFACT: "its positionless edge"}
    missing = [name for key, name in waiting.items() if key in point.overrides and flat.get(key) != point.overrides[key]]
    return f"{' and '.join(missing)} not prepared yet: attacks listed as without them" if missing else ""


def _reason(failure: Mapping[str, Any]) -> str:
    """One line: the error's type and message (for a client's fault, the last line of the
    traceback it sent, which names the client's own exception)."""
    error = str(failure.get("error") or "").strip()
    if not error:
        return ""
    lines = error.splitlines()
    return lines[-1].strip() if len(lines) > 1 else f"{failure.get('error_type', 'error')}: {error}"


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for row in rows:
        print("  ".join(str(row[k]).ljust(w) for k, w in widths.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qpriv-sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run (or resume) every point and replay its attacks"),
                            ("status", "each point's state")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("file", help="a sweep file (.toml, .yaml)")
        command.add_argument("--out", help="the sweep folder (default ~/qpriv-sweeps/<file stem>)")
        command.add_argument("--points", action="append", metavar="PATTERN",
                             help="only the points whose run names match this shell pattern; repeatable")
        if name == "run":
            command.add_argument("--archive", type=Path, metavar="DIR",
                                 help="copy each point's results into DIR as they are made, and restore from DIR the "
                                      "points this machine lacks (e.g. results/sweeps/<file stem>; sims/archive.py)")
            command.add_argument("--runner", choices=RUNNERS,
                                 help="flwr: each run through `flwr run` (default); inprocess: the same apps in this process")
            command.add_argument("--no-progress", action="store_true", help="no progress bar")
            command.add_argument("--allow-dirty", action="store_true",
                                 help="run although the working tree's code differs from its commit; the sweep "
                                      "folder's start and every table rendered from it are marked as not "
                                      "reproducible from the commit")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.file, runner=getattr(args, "runner", None), out=args.out)
    except SweepError as error:
        print(f"qpriv-sweep: {error}", file=sys.stderr)
        return 2
    if args.points:
        sweep.points = [p for p in sweep.points if any(fnmatch.fnmatchcase(p.name, pat) for pat in args.points)]
        if not sweep.points:
            print(f"qpriv-sweep: no point matches {args.points}", file=sys.stderr)
            return 2
    if args.command == "status":
        print(f"sweep folder: {sweep.folder}")
        _print_table(status_rows(sweep))
        return 0
    sweep.archive = args.archive
    print(f"sweep folder: {sweep.folder} ({len(sweep.points)} points, runner {sweep.runner})"
          + (f", archived in {sweep.archive}" if sweep.archive else ""))
    try:
        states = run_sweep(sweep, allow_dirty=args.allow_dirty, progress=not args.no_progress)
    except DirtyTree as error:
        print(f"qpriv-sweep: {error}", file=sys.stderr)
        return 2
    failed = {name: state for name, state in states.items() if state != "finished"}
    print(f"{len(states) - len(failed)} of {len(states)} points finished" +
          (f"; not: {', '.join(f'{n} ({s})' for n, s in failed.items())}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
