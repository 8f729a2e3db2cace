"""What a result was measured on, so that a reviewer can check it: the commit, the models' weights,
the seeds, the mini recipes, the time, the machine and how loaded it was.

A result is reproducible from its commit only if the code that ran is the commit's: `provenance()`
refuses a working tree whose code differs from it (`DirtyTree`, naming the changed paths) unless
the caller forces it (`--allow-dirty` on every benchmark and on `qpriv-sweep run`). A forced
stamp says so ("dirty": true, the commit suffixed "+dirty"), and `dirty_warning` is the line every
table rendered from it carries (benchmarks/report.py's `write_markdown`).

A sweep stamps its folder's sweep.json with one per start; every benchmark stores one in its
results/<name>.json.
"""

import json
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

REPOSITORY = Path(__file__).parents[1]
DIRTY = "+dirty"
# What a run writes, or what only describes or checks it: changes there do not alter what a result ran.
NOT_RUN = ("results/", "docs/", "notebooks/", "tests/")
NOT_RUN_SUFFIXES = (".md",)
# An untracked file counts only if it can change what runs: code, or a config or sweep file.
RUN_SUFFIXES = (".py", ".toml", ".yaml", ".yml")
NAMED = 5  # changed paths a refusal names
KEPT = 20  # changed paths a forced stamp keeps


class DirtyTree(RuntimeError):
    """The working tree's code is not its commit's; the message names the paths and how to force."""


def _git(repository: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=repository, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _runs(path: str) -> bool:
    return not path.startswith(NOT_RUN) and not path.endswith(NOT_RUN_SUFFIXES)


def changed_paths(repository: Path = REPOSITORY) -> list[str] | None:
    """The paths whose content the commit does not hold and that can change what runs: tracked files
    modified, added, deleted or renamed (staged or not), and untracked, not ignored code and config
    files; none under NOT_RUN, nor markdown. None when `repository` is no git checkout."""
    status = _git(repository, "status", "--porcelain=v1", "-z", "--untracked-files=all")
    if status is None:
        return None
    entries, changed = iter(status.split("\0")), []
    for entry in entries:
        if not entry:
            continue
        code, path = entry[:2], entry[3:]
        if code[0] in "RC":
            next(entries, None)  # -z puts a rename's source after it, unprefixed
        if code == "??" and not path.endswith(RUN_SUFFIXES):
            continue
        if _runs(path):
            changed.append(path)
    return changed


def model_identity(profile: str, root: Path | None = None, *, stage: str | None = None) -> str:
    """The weights a result ran: for a mini profile its recipe and its built weights' digest (under
    `root`, default where mini builds); for another, where its weights come from; at model.stage
    "random", none of these."""
    from vlm.mini import RECIPES, weights_identity
    from vlm.profiles import get_profile

    if stage == "random":
        return f"{profile}: random weights (model.seed)"
    if profile in RECIPES:
        return weights_identity(profile, root)
    hf_id = get_profile(profile).hf_id
    return f"{profile}: {hf_id} from the Hugging Face hub" if hf_id else f"{profile}: random weights (model.seed)"


def seeds_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A flat run config's seeds (every key whose last part names a seed: data.seed, threat.fsha_seed...)."""
    return {key: value for key, value in sorted(config.items()) if "seed" in key.rsplit(".", 1)[-1]}


def of_runs(configs: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """`seeds` and `models` for provenance() from the flat run configs a result ran: each seed key's
    value (the sorted list of values where runs differ), each profile's weights."""
    configs = list(configs)
    models = {}
    for config in configs:
        profile, stage = config.get("model.profile"), config.get("model.stage")
        if profile:
            key = f"{profile} (model.stage random)" if stage == "random" else profile
            models.setdefault(key, model_identity(profile, stage=stage))
    return {"seeds": _union([seeds_of(config) for config in configs]), "models": dict(sorted(models.items()))}


def provenance(
    *,
    allow_dirty: bool = False,
    seeds: Mapping[str, Any] | None = None,
    models: Iterable[str] | Mapping[str, str] = (),
    repository: Path = REPOSITORY,
) -> dict[str, Any]:
    """The stamp of a result measured now: the commit; "dirty" and the changed paths when forced
    (`allow_dirty`) past a tree whose code is not the commit's, which otherwise raises DirtyTree;
    `seeds` (name -> value, as the caller draws them; None: not recorded); `models`, the profiles
    the result ran (their weights' identity, model_identity) or profile -> identity where the caller
    knows it better; the mini recipe and every offline profile's with the digest of the weights
    built here; time; machine, its load average (1, 5, 15 minutes) and CPU count."""
    if isinstance(models, str):
        models = [models]
    head = (_git(repository, "rev-parse", "--short=12", "HEAD") or "").strip()
    changed = changed_paths(repository) if head else None
    # No commit, or git cannot say what changed: nothing a reviewer could check it against.
    dirty = changed is None or bool(changed)
    if dirty and not allow_dirty:
        raise DirtyTree(_refusal(repository, head, changed))
    stamp: dict[str, Any] = {
        "commit": (head or "unknown") + (DIRTY if dirty else ""),
        "dirty": dirty,
    }
    if dirty:
        stamp["changed_paths"] = None if changed is None else len(changed)
        stamp["changed"] = None if changed is None else changed[:KEPT]
    return {
        **stamp,
        "models": dict(models) if isinstance(models, Mapping) else {name: model_identity(name) for name in models},
        "seeds": None if seeds is None else dict(seeds),
        **_builds(),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }


def _builds() -> dict[str, Any]:
    """The mini recipe, every offline profile's, and the weights built here from each."""
    from vlm.mini import RECIPES, weights_identity

    return {
        "mini_recipe": RECIPES["mini"].fingerprint(),
        "recipes": {name: recipe.fingerprint() for name, recipe in RECIPES.items()},
        "weights": {name: weights_identity(name) for name in RECIPES},
    }


def _refusal(repository: Path, head: str, changed: list[str] | None) -> str:
    force = ("pass --allow-dirty (allow_dirty=True) to measure anyway: the result is then marked "
             "as not reproducible from its commit")
    if not head:
        return f"{repository} is not a git checkout, so no commit can name what this result ran; {force}"
    if changed is None:
        return f"git status failed in {repository}, so what changed since commit {head} is unknown; {force}"
    named = ", ".join(changed[:NAMED]) + (f" and {len(changed) - NAMED} more" if len(changed) > NAMED else "")
    return (f"the working tree differs from commit {head} in {len(changed)} path(s) that can change what runs "
            f"({named}): commit or stash them, or {force}")


def is_dirty(stamp: Mapping[str, Any] | None) -> bool:
    """Whether a stamp says its result ran on code that is not its commit's: "dirty" set, or any commit
    it names suffixed "+dirty" (older stamps, and a sweep's starts joined into one)."""
    stamp = stamp or {}
    return bool(stamp.get("dirty")) or DIRTY in str(stamp.get("commit", ""))


def dirty_warning(stamp: Mapping[str, Any] | None) -> str | None:
    """The line every table rendered from a dirty stamp carries (None for a clean one)."""
    if not is_dirty(stamp):
        return None
    count = (stamp or {}).get("changed_paths")
    if str((stamp or {}).get("commit", "")).startswith("unknown"):
        where = "outside a git checkout"
    else:
        where = f"on a dirty tree ({count} changed path{'' if count == 1 else 's'})" if isinstance(count, int) \
            else "on a dirty tree (changed paths not recorded)"
    return f"**Warning: measured {where}: not reproducible from the commit.**"


def merge(stamps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One stamp for a result made over several starts (a sweep's): the first's, with every commit
    named, dirty if any start was (with the most changed paths any start had, and every path the
    dirty starts kept), every start's seeds and models."""
    first = dict(stamps[0])
    merged = {**first, "commit": ", ".join(dict.fromkeys(str(s.get("commit")) for s in stamps)),
              "measured": f"{first.get('measured')}, the first of {len(stamps)} starts" if len(stamps) > 1
              else first.get("measured")}
    if any("dirty" in s for s in stamps):
        dirty = [s for s in stamps if is_dirty(s)]
        counts = [s.get("changed_paths") for s in dirty]
        merged["dirty"] = bool(dirty)
        merged.pop("changed_paths", None)
        merged.pop("changed", None)
        if dirty:
            merged["changed_paths"] = max(counts) if all(isinstance(c, int) for c in counts) else None
            merged["changed"] = sorted({path for s in dirty for path in s.get("changed") or []})
    for key in ("seeds", "models"):
        if any(key in s for s in stamps):
            merged[key] = _union([s.get(key) or {} for s in stamps])
    return merged


def _union(mappings: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """key -> the one value every mapping gives it, or the sorted list of their different values."""
    values: dict[str, list[Any]] = {}
    for mapping in mappings:
        for key, value in mapping.items():
            for item in value if isinstance(value, list) else [value]:
                if item not in values.setdefault(key, []):
                    values[key].append(item)
    return {key: items[0] if len(items) == 1 else sorted(items, key=json.dumps)
            for key, items in sorted(values.items())}
