"""What "prepare DTP" leaves behind, in one folder (`pruning.artifacts`), and how policies read it.

- `dtp.pt`: the trained QPrivVL module (the student) that the dtp policy runs.
- `oracle.pt`: the oracle's per-sample prune ratios keyed by `oracle_key`, with the fixed
  scorer they were searched with: an oracle ratio only means something under the
  ranking that found it, so the oracle policy ranks with that very scorer.

Each file records the model profile, the fusion weights α and β it was made with and
its encoders' fingerprint; loading refuses any mismatch, because scores from other
encoders or another fusion would be silently wrong.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pruning.encoders import FrozenEncoders
from pruning.module import QPrivVL
from pruning.profiles import PruningProfile
from vqa import VQASample

DTP_FILE = "dtp.pt"
ORACLE_FILE = "oracle.pt"


class ArtifactError(ValueError):
    """A pruning artefact that is missing or was made for something else."""


def oracle_key(sample: VQASample) -> str:
    """A sample's key in the oracle table: dataset/split/id, because sample ids are only
    unique within one split (easy-VQA's are row numbers), and one preparation searches
    several datasets and both a training and an evaluation split."""
    return f"{sample.dataset}/{sample.split}/{sample.id}"


def _record(module: QPrivVL, encoders: FrozenEncoders) -> dict[str, Any]:
    return {
        "profile": module.profile.name,
        "alpha": module.alpha,
        "beta": module.beta,
        "encoders": encoders.fingerprint,
        "state": module.state_dict(),
    }


def _load_module(
    path: Path, profile: PruningProfile, encoders: FrozenEncoders, alpha: float, beta: float
) -> tuple[QPrivVL, dict[str, Any]]:
    if not path.is_file():
        raise ArtifactError(f"pruning artefact {path} does not exist; run the DTP preparation into {path.parent}")
    record = torch.load(path, weights_only=True)
    for field, expected in (
        ("profile", profile.name),
        ("alpha", alpha),
        ("beta", beta),
        ("encoders", encoders.fingerprint),
    ):
        if record[field] != expected:
            raise ArtifactError(
                f"{path} was made with {field}={record[field]!r}, but this run has {field}={expected!r}; "
                "prepare the artefacts with this run's settings"
            )
    module = QPrivVL(profile, alpha=alpha, beta=beta)
    module.load_state_dict(record["state"])
    return module.eval().requires_grad_(False), record


def save_dtp(folder: str | Path, module: QPrivVL, encoders: FrozenEncoders) -> Path:
    """Write the trained module to `folder`/dtp.pt."""
    path = Path(folder) / DTP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_record(module, encoders), path)
    return path


def load_dtp(
    folder: str | Path, profile: PruningProfile, encoders: FrozenEncoders, *, alpha: float, beta: float
) -> QPrivVL:
    """The trained module from `folder`/dtp.pt, frozen."""
    module, _ = _load_module(Path(folder) / DTP_FILE, profile, encoders, alpha, beta)
    return module


def save_oracle(
    folder: str | Path, ratios: Mapping[str, float], scorer: QPrivVL, encoders: FrozenEncoders
) -> Path:
    """Write the oracle's ratios (`oracle_key` -> ρ* in [0, 1]) and their scorer to `folder`/oracle.pt."""
    outside = {sample_id: ratio for sample_id, ratio in ratios.items() if not 0 <= ratio <= 1}
    if outside:
        raise ValueError(f"oracle ratios must lie in [0, 1]; got {dict(list(outside.items())[:5])}")
    path = Path(folder) / ORACLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**_record(scorer, encoders), "ratios": {str(key): float(value) for key, value in ratios.items()}}, path)
    return path


def load_oracle(
    folder: str | Path, profile: PruningProfile, encoders: FrozenEncoders, *, alpha: float, beta: float
) -> tuple[QPrivVL, dict[str, float]]:
    """The oracle's scorer (frozen) and its ratios by `oracle_key`, from `folder`/oracle.pt."""
    scorer, record = _load_module(Path(folder) / ORACLE_FILE, profile, encoders, alpha, beta)
    return scorer, record["ratios"]
