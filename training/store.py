"""A party's private state on its own disk, one snapshot per round, one file per part.

A warm process snapshots a client's adapters, optimiser state and step counter once
per turn; in deployment mode every message runs in a fresh process, so there they
must be on its disk after every message (clients.runtime). Python globals and
`context.state` (serialised into every message) are the wrong place for a 7B
model's LoRA and AdamW.

A snapshot is a folder `round-NNNNNN/` with one file per part (e.g. a USL client's
"head", "tail" and "progress"), so a message rewrites only the part it changed: in
deployment the USL tail step writes the tail, the head step the head. A round's folder starts as
hard links to the previous snapshot's files, so every snapshot is complete.

Snapshots are per round so that a resumed run can go back to the round the server
last committed: a killed run may have left a newer, half-finished snapshot, which
`begin_round` discards.
"""

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

_SNAPSHOT = re.compile(r"round-(\d{6})")
_PART_SUFFIX = ".pt"
# A token rewritten by every save: file times can be too coarse to tell two saves apart.
_VERSION = "VERSION"
# The node ids that held this party's state: a federation gives its nodes new ids each start.
NODES_FILE = "nodes.json"


class PrivateStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _snapshots(self) -> dict[int, Path]:
        found = {}
        for path in self.directory.iterdir():
            match = _SNAPSHOT.fullmatch(path.name)
            if match and path.is_dir():
                found[int(match.group(1))] = path
        return found

    def path(self, name: str) -> Path:
        """A file of the party's own beside the snapshots (caches, scratch)."""
        return self.directory / name

    def record_node(self, node_id: int) -> None:
        """Note that node `node_id` holds this state, so a run's recording (which names nodes)
        can be scored against the right partition."""
        if node_id not in self.nodes():
            self.path(NODES_FILE).write_text(json.dumps([*self.nodes(), node_id]))

    def nodes(self) -> list[int]:
        path = self.path(NODES_FILE)
        return json.loads(path.read_text()) if path.exists() else []

    def begin_round(self, committed_round: int) -> None:
        """Forget snapshots newer than the server's last committed round (a killed run's
        leftovers) and older ones but the newest, which is where this round starts."""
        snapshots = self._snapshots()
        kept = max((r for r in snapshots if r <= committed_round), default=None)
        for round_, path in snapshots.items():
            if round_ != kept:
                shutil.rmtree(path)

    def version(self) -> tuple[int, str] | None:
        """Identifies the newest snapshot's content, so a warm process can skip reloading it."""
        snapshots = self._snapshots()
        if not snapshots:
            return None
        latest = max(snapshots)
        token = snapshots[latest] / _VERSION
        return latest, token.read_text() if token.exists() else ""

    def load(self) -> dict[str, Any] | None:
        """Every part of the newest snapshot, by name; None before the first save."""
        snapshots = self._snapshots()
        if not snapshots:
            return None
        folder = snapshots[max(snapshots)]
        return {
            part.name.removesuffix(_PART_SUFFIX): torch.load(part, weights_only=True)
            for part in folder.glob(f"*{_PART_SUFFIX}")
        }

    def save(self, round_: int, parts: dict[str, Any]) -> None:
        """Write `parts` into round `round_`'s snapshot, each atomically: a kill mid-write
        leaves the previous file intact."""
        snapshots = self._snapshots()
        folder = self.directory / f"round-{round_:06d}"
        if round_ not in snapshots:
            folder.mkdir()
            previous = max((r for r in snapshots if r < round_), default=None)
            if previous is not None:
                for part in snapshots[previous].glob(f"*{_PART_SUFFIX}"):
                    os.link(part, folder / part.name)
        for name, state in parts.items():
            partial = folder / f"{name}.partial"
            torch.save(state, partial)
            os.replace(partial, folder / f"{name}{_PART_SUFFIX}")
        partial = folder / f"{_VERSION}.partial"
        partial.write_text(uuid.uuid4().hex)
        os.replace(partial, folder / _VERSION)
