"""A party's private state on its own disk, one snapshot per round.

In deployment mode every message may run in a fresh process, so a client's adapters,
optimiser state and step counter must be on its disk after every message; Python
globals and `context.state` (serialised into every message) are the wrong place
for a 7B model's LoRA and AdamW.

Snapshots are per round so that a resumed run can go back to the round the server
last committed: a killed run may have left a newer, half-finished snapshot, which
`begin_round` discards.
"""

import os
import re
from pathlib import Path
from typing import Any

import torch

_SNAPSHOT = re.compile(r"round-(\d{6})\.pt")


class PrivateStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _snapshots(self) -> dict[int, Path]:
        found = {}
        for path in self.directory.iterdir():
            match = _SNAPSHOT.fullmatch(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    def path(self, name: str) -> Path:
        return self.directory / name

    def begin_round(self, committed_round: int) -> None:
        """Forget snapshots newer than the server's last committed round (a killed run's
        leftovers) and older ones but the newest, which is where this round starts."""
        snapshots = self._snapshots()
        kept = max((r for r in snapshots if r <= committed_round), default=None)
        for round_, path in snapshots.items():
            if round_ != kept:
                path.unlink()

    def version(self) -> tuple[int, int] | None:
        """Identifies the newest snapshot (round, mtime), so a warm process can skip reloading it."""
        snapshots = self._snapshots()
        if not snapshots:
            return None
        latest = max(snapshots)
        return latest, snapshots[latest].stat().st_mtime_ns

    def load(self) -> dict[str, Any] | None:
        snapshots = self._snapshots()
        if not snapshots:
            return None
        return torch.load(snapshots[max(snapshots)], weights_only=True)

    def save(self, round_: int, state: dict[str, Any]) -> None:
        """Write atomically: a kill mid-write leaves the previous snapshot intact."""
        target = self.directory / f"round-{round_:06d}.pt"
        partial = target.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, target)
