"""Run folders as pandas frames: what every table, claim and figure is drawn from.

    results = load_results("~/qpriv-sweeps/paradigms", "~/qpriv-runs/my-run")
    results.runs       # one row per run: its settings, seed, state and final metrics
    results.rounds     # one row per run x round (metrics.jsonl)
    results.attacks    # one row per run x attack result (<run>/attacks/<label>.json)
    results.outcomes   # one row per run x test question of its last evaluated round
    results.incomplete # run folders that could not be read, and why

Any folder is searched for run folders (those holding config.json), so a sweep folder, a
folder of sweeps, a sweep's archive (sims/archive.py) or single runs all load the same way. A run folder that lacks a file or
holds a torn one is listed in `incomplete` with the reason, never raised. A defended run's
`defense_setting` names each defense with its strength and the options that differ from its
defaults; a single-defense run also has a `defense_series` (the setting without its strength) and
a `defense_strength`, the frontier's line and x. A run's `seed` is its model.seed (a sweep's seeds
axis sets every seed of a run to it); `hijacked` says whether its server hijacked the clients'
training (their accuracy is then not an honest run's); `start` is the commit of the sweep's start
that made it (a reference is paired only with points of its own start) and `dirty` whether that
tree had uncommitted changes.

An attack result's `attack` is the label it was saved under: a sweep may replay one attack
several times with other options (`[attacks.actinv_masked] attack = "actinv"`), and each label
is its own `attack` value ("actinv_masked", "fora_adaptive") beside the plain one; `base_attack`
is the registered attack behind it (the headline metric comes from it).
"""

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from safetensors.torch import load_file
from sklearn.metrics import roc_curve

from analysis.provenance import DIRTY, is_dirty
from attacks.context import ATTACK_FOLDER
from config import threats
from config.schema import ClientsConfig, PruningShared
from privacy import defense_class, options_from, parse_defense_names
from pruning import POLICIES
from training.protocol import ARCHIVE_MARKER, OUTCOMES_FILE, SWEEP_STAMP

# Settings every table carries, from the run's resolved config.
SETTINGS = {
    "paradigm": "paradigm", "profile": "model.profile", "dataset": "data.dataset", "policy_name": "pruning.policy",
    "ratio": "pruning.ratio", "threat": "threat.model", "clients": "clients.count", "rounds_planned": "train.rounds",
    "steps_per_round": "train.steps_per_round", "batch_size": "train.batch_size", "seed": "model.seed",
    "sampling": "clients.sampling", "update_canaries": "threat.update_canaries",
}
# The config key naming a run's defenses at the cut, in order ("noise,pripert"; "" or "none": none);
# each one's options are the keys under privacy.<name>.
DEFENSES_KEY = "privacy.defenses"
NO_DEFENSE = "none"
HIJACKING_THREATS = frozenset(model.name for model in threats.THREAT_MODELS if model.hijacks)


@dataclass
class Results:
    runs: pd.DataFrame
    rounds: pd.DataFrame
    attacks: pd.DataFrame
    outcomes: pd.DataFrame
    incomplete: pd.DataFrame

    def finished(self) -> pd.DataFrame:
        return self.runs[self.runs["state"] == "finished"]

    def honest(self) -> pd.DataFrame:
        """The finished runs whose server did not hijack the clients' training."""
        runs = self.finished()
        return runs[~runs["hijacked"]] if "hijacked" in runs else runs


def find_run_folders(paths: Iterable[str | Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        path = Path(path).expanduser()
        if (path / "config.json").exists():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(p.parent for p in path.rglob("config.json")
                                if (p.parent / "checkpoints").is_dir() or (p.parent / ARCHIVE_MARKER).is_file()))
    return list(dict.fromkeys(found))


def policy_label(config: dict[str, Any]) -> str:
    """The run's pruning policy as the papers name it, with its budget where it has one: off, fixed-0.5, dtp, oracle;
    DTP at another α than the paper's 1 (relevance against sensitivity) with it: dtp-a0, dtp-a0.5."""
    policy = config.get("pruning.policy", "off")
    budget = POLICIES.get(policy).budget if policy in POLICIES else None
    label = policy if budget is None else f"{policy}-{config.get(f'pruning.{budget}', 0.0):g}"
    alpha = float(config.get("pruning.alpha", PruningShared.alpha))
    return f"{label}-a{alpha:g}" if policy == "dtp" and alpha != PruningShared.alpha else label


def defense_names(config: dict[str, Any]) -> list[str]:
    """The run's defenses at the cut, in order."""
    return parse_defense_names(str(config.get(DEFENSES_KEY) or ""))


def _configured(config: dict[str, Any], name: str) -> dict[str, Any]:
    """Defense `name`'s options as the run's config holds them (its keys `privacy.<name>.<option>`)."""
    prefix = f"privacy.{name}."
    return {key[len(prefix):]: value for key, value in sorted(config.items()) if key.startswith(prefix)}


def _strength_option(config: dict[str, Any], name: str) -> str | None:
    """The option that sets defense `name`'s strength in the run (None: it has none)."""
    defense = defense_class(name)
    declared = asdict(defense.Options())
    return defense.strength_option(options_from(defense, {option: value for option, value in
                                                          _configured(config, name).items() if option in declared}))


def _options(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A defense's options in the run that differ from the defense's defaults, and its strength."""
    defaults = asdict(defense_class(name).Options())
    strength = _strength_option(config, name)
    return {option: value for option, value in _configured(config, name).items()
            if value != defaults.get(option) or option == strength}


def _label(name: str, options: dict[str, Any]) -> str:
    def shown(key: str, value: Any) -> str:
        if isinstance(value, float):
            return f"{value:g}"
        # An artefact by its folder's name (a sweep's positionless edge: its label).
        return Path(value).name if key == "artifact" else str(value)

    text = ", ".join(f"{key}={shown(key, value)}" for key, value in options.items())
    return f"{name}({text})" if text else name


def defense_setting(config: dict[str, Any]) -> str:
    """The defenses with their strength and the options that differ from their defaults:
    "sparsify(ratio=0.7)+noise(variance=0.01)"."""
    names = defense_names(config)
    return "+".join(_label(name, _options(config, name)) for name in names) if names else NO_DEFENSE


def privacy_setting(config: dict[str, Any]) -> str:
    """The run's guarantees: "none", "central(eps=8)", "secagg+central-client-clipping(eps=8)",
    "sgd(z=1.1)" — privacy.dp's mode with its target epsilon (else its noise multiplier), and
    SecAgg+ when on."""
    parts = ["secagg"] if config.get("privacy.secagg.enabled") else []
    mode = config.get("privacy.dp.mode", "off")
    if mode != "off":
        target, z = config.get("privacy.dp.target_epsilon", 0.0), config.get("privacy.dp.noise_multiplier", 0.0)
        parts.append(f"{mode}(eps={target:g})" if target else f"{mode}(z={z:g})")
    return "+".join(parts) if parts else NO_DEFENSE


def cohort(config: dict[str, Any]) -> int:
    """The clients an FL round averages (under poisson sampling: the expected cohort)."""
    clients = ClientsConfig(count=config.get("clients.count", ClientsConfig.count),
                            fraction_train=config.get("clients.fraction_train", ClientsConfig.fraction_train),
                            sampling=config.get("clients.sampling", ClientsConfig.sampling))
    return clients.sampled


def defense_series(config: dict[str, Any]) -> tuple[str, float | None]:
    """A single-defense run's series (its setting without its strength option) and that
    strength: the frontier draws one line per series along the strength."""
    names = defense_names(config)
    option = _strength_option(config, names[0]) if len(names) == 1 else None
    if option is None:
        return defense_setting(config), None
    name = names[0]
    options = _options(config, name)
    strength = options.get(option, asdict(defense_class(name).Options())[option])
    return _label(name, {k: v for k, v in options.items() if k != option}), float(strength)


def _read_run(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(run row, round rows, attack rows, outcome rows); raises ValueError naming what is missing or torn."""
    def read(name: str) -> Any:
        path = folder / name
        if not path.exists():
            raise ValueError(f"no {name}")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is torn ({error.msg} at line {error.lineno})") from None

    config = read("config.json")["config"]
    status = read("status.json")
    rounds = []
    metrics_file = folder / "metrics.jsonl"
    if metrics_file.exists():
        for number, line in enumerate(metrics_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rounds.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"metrics.jsonl line {number} is torn") from None
    name = folder.name
    defenses = defense_names(config)
    row: dict[str, Any] = {
        "run": name, "folder": str(folder), "sweep": folder.parent.parent.name if folder.parent.name == "runs" else "",
        **{column: config.get(key) for column, key in SETTINGS.items()},
        "policy": policy_label(config),
        "defenses": "+".join(defenses) if defenses else NO_DEFENSE, "defense_setting": defense_setting(config),
        **dict(zip(("defense_series", "defense_strength"), defense_series(config), strict=True)),
        "privacy_setting": privacy_setting(config), "hijacked": config.get("threat.model") in HIJACKING_THREATS,
        "cohort": cohort(config),
        "accountant_epsilon": (status.get("privacy_spent") or {}).get("dp_epsilon"),
        "state": status.get("state"), "error": status.get("error", ""), "rounds_done": len(rounds),
        "config": config,
    }
    if rounds:
        scored = [r for r in rounds if r.get("test_accuracy") is not None]
        row.update(
            test_accuracy=scored[-1]["test_accuracy"] if scored else None,
            test_count=scored[-1].get("test_count") if scored else None,
            zero_shot_accuracy=scored[-1].get("zero_shot_accuracy") if scored else None,
            train_loss=rounds[-1].get("train_loss"),
            kept_tokens_mean=_mean(r.get("kept_tokens_mean") for r in rounds),
            kept_tokens_share=_mean(r.get("kept_tokens_mean_share") for r in rounds),
            patches_removed_share=_mean(r.get("patches_removed_share") for r in rounds),
            mark_patches_removed_share=_mean(r.get("mark_patches_removed_share") for r in rounds),
            exclusion_ratio=_mean(r.get("exclusion_ratio_mean") for r in rounds),
            bytes_up=sum(r.get("bytes_up", 0) for r in rounds), bytes_down=sum(r.get("bytes_down", 0) for r in rounds),
            round_trips=sum(r.get("round_trips_train", 0) + r.get("round_trips_eval", 0) for r in rounds),
            round_trips_per_step=_mean(r.get("round_trips_per_step") for r in rounds),
            steps=sum(r.get("steps", 0) for r in rounds),
            wall_s=status.get("wall_s") or sum(r.get("wall_s", 0) for r in rounds),
        )
    round_rows = [{"run": name, **{k: v for k, v in r.items() if not isinstance(v, (dict, list))}} for r in rounds]
    attack_rows = []
    attack_folder = folder / ATTACK_FOLDER
    for path in sorted(attack_folder.glob("*.json")) if attack_folder.exists() else []:
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{ATTACK_FOLDER}/{path.name} is torn") from None
        label = result.get("attack", path.stem)
        base = (result.get("details") or {}).get("base_attack", label)
        attack_rows.append({"run": name, "attack": label, "base_attack": base, **result.get("metrics", {})})
    return row, round_rows, attack_rows, _last_outcomes(folder, name)


def _last_outcomes(folder: Path, name: str) -> list[dict[str, Any]]:
    """Each test question's score in the run's last evaluated round (OUTCOMES_FILE: one line per
    round, parallel lists in the test split's order), as rows run, item (the question's id, else its
    position in the split), score (and zero_shot where the run scored one); none for a run that
    recorded none."""
    path = folder / OUTCOMES_FILE
    if not path.exists():
        return []
    last: dict[str, Any] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{OUTCOMES_FILE} line {number} is torn") from None
        if last is None or int(record["round"]) >= int(last["round"]):
            last = record
    if last is None:
        return []
    items = last.get("questions") or last["positions"]
    zero_shot = last.get("zero_shot")
    return [{"run": name, "item": str(item), "score": float(score),
             **({"zero_shot": float(zero_shot[index])} if zero_shot else {})}
            for index, (item, score) in enumerate(zip(items, last["scores"], strict=True))]


def outcome_frame(rows: list[dict[str, Any]], runs: pd.DataFrame) -> pd.DataFrame:
    """The outcome rows with their runs' settings, so a setting's outcomes are picked by its columns."""
    frame = pd.DataFrame(rows, columns=["run", "item", "score", *(["zero_shot"] if any("zero_shot" in r for r in rows) else [])])
    if frame.empty or runs.empty:
        return frame
    settings = [c for c in runs.columns if c not in ("config", "folder", "error") and c not in frame]
    return frame.merge(runs[["run", *settings]], on="run", how="left")


def _mean(values: Iterable[Any]) -> float | None:
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def sweep_starts(sweep: Path) -> dict[str, str]:
    """Point → the commit of the first start of the sweep that named it (what its run was made by;
    "+dirty" where that start's tree was dirty); empty for a folder without a readable sweep.json."""
    try:
        starts = json.loads((sweep / SWEEP_STAMP).read_text()).get("starts", [])
    except (OSError, json.JSONDecodeError):
        return {}
    made_by: dict[str, str] = {}
    for start in starts:
        commit = str(start.get("commit", "unknown"))
        if is_dirty(start) and DIRTY not in commit:
            commit += DIRTY
        for point in start.get("points", []):
            made_by.setdefault(point, commit)
    return made_by


def load_results(*paths: str | Path) -> Results:
    runs, rounds, attacks, outcomes, incomplete = [], [], [], [], []
    starts: dict[Path, dict[str, str]] = {}
    for folder in find_run_folders(paths):
        try:
            row, round_rows, attack_rows, outcome_rows = _read_run(folder)
        except (ValueError, KeyError) as error:
            incomplete.append({"run": folder.name, "folder": str(folder), "reason": str(error)})
            continue
        if folder.parent.name == "runs":
            sweep = folder.parent.parent
            starts.setdefault(sweep, sweep_starts(sweep))
            row["start"] = starts[sweep].get(folder.name)
        row["dirty"] = DIRTY in str(row.get("start") or "")
        runs.append(row)
        rounds.extend(round_rows)
        attacks.extend(attack_rows)
        outcomes.extend(outcome_rows)
    run_frame = pd.DataFrame(runs)
    attack_frame = pd.DataFrame(attacks)
    if not attack_frame.empty:
        # Every attack row carries its run's settings, so a table groups by them directly.
        keep = ["run", "sweep", "start", "seed", "paradigm", "profile", "policy", "policy_name", "threat", "hijacked", "defenses", "defense_setting", "defense_series",
                "defense_strength", "privacy_setting", "accountant_epsilon", "kept_tokens_mean", "test_accuracy"]
        # An attack's own copy of a run setting (the membership audits report the accountant's ε)
        # gives way to the run's, which the tables read under its own name.
        shared = [c for c in keep if c != "run" and c in run_frame and c in attack_frame]
        attack_frame = attack_frame.drop(columns=shared).merge(run_frame[[c for c in keep if c in run_frame]], on="run",
                                                               how="left")
    return Results(run_frame, pd.DataFrame(rounds), attack_frame, outcome_frame(outcomes, run_frame),
                   pd.DataFrame(incomplete, columns=["run", "folder", "reason"]))


# --- what the figures need beyond the tables ----------------------------------------------------


def mia_roc(folder: str | Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(FPR, TPR) of a run's saved MIA scores (None: no MIA result with scores)."""
    path = Path(folder) / ATTACK_FOLDER / "mia.safetensors"
    if not path.exists():
        return None
    saved = load_file(str(path))
    labels, scores = saved["is_member"].numpy().astype(bool), saved["scores"].numpy()
    if labels.all() or not labels.any():
        return None
    fpr, tpr, _ = roc_curve(labels, scores)
    return fpr, tpr


def reconstructions(folder: str | Path, attack: str, count: int = 8) -> tuple[np.ndarray, np.ndarray] | None:
    """The first `count` (originals, reconstructions) of an image attack, as (N, H, W, 3) in [0, 1]."""
    path = Path(folder) / ATTACK_FOLDER / f"{attack}.safetensors"
    if not path.exists():
        return None
    saved = load_file(str(path))
    if "reconstructions" not in saved or "targets" not in saved:
        return None
    def images(tensor):
        return tensor[:count].float().clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return images(saved["targets"]), images(saved["reconstructions"])
