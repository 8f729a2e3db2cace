"""What a measurement was taken on: the commit, the mini recipe, the machine.

A sweep stamps its folder with it when it starts (the commit its runs were made with), and
every benchmark stores it in its results/<name>.json.
"""

import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

REPOSITORY = Path(__file__).parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPOSITORY, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def provenance() -> dict[str, Any]:
    """Commit (with '+dirty' for uncommitted changes to tracked files), the mini recipe and every
    offline profile's (mini-positional's differs by its position loss) with the digest of the
    weights built from it here, time, machine."""
    from vlm.mini import RECIPES, weights_identity

    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {
        "commit": commit,
        "mini_recipe": RECIPES["mini"].fingerprint(),
        "recipes": {name: recipe.fingerprint() for name, recipe in RECIPES.items()},
        "weights": {name: weights_identity(name) for name in RECIPES},
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
    }
