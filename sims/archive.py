"""A sweep's measurements kept in the repository, where losing the machine cannot take them.

A shipped sweep runs for hours on 2 cores, often over several sessions, and its folder
(~/qpriv-sweeps/<name>) lives on one machine. `qpriv-sweep run FILE --archive DIR` copies each
point into DIR as soon as its run or one of its attacks is done, and before running restores
into the sweep folder every point that DIR holds complete and the sweep folder lacks, so a new
machine goes on where the last one stopped (`results/sweeps/<name>` is the shipped sweeps'
archive, committed with their reports).

An archive is laid out as a sweep folder: `sweep.json` (every start, from every machine),
`points/<point>.json` and `runs/<point>/`. An archived run folder keeps what results are read
from (RUN_FILES, the attack results' JSON, and their outputs up to MAX_OUTPUT_BYTES each) and
ARCHIVE_MARKER (when, from which sweep folder, what was left out). Not its checkpoints, recording or
clients' state: a restored point can be read, not resumed or attacked again; an attack it
lacks needs the run again (delete its folder). `analysis.runs.load_results` reads an archive as
it reads a sweep folder.
"""

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from attacks.context import ATTACK_FOLDER
from attacks.update_canaries import UPDATE_CANARIES_FILE
from strategies.callbacks import CANARIES_FILE, write_json_atomically
from training.protocol import ARCHIVE_MARKER, NODE_PARTITIONS_FILE, OUTCOMES_FILE, SWEEP_STAMP

RUN_FILES = ("config.json", "status.json", "metrics.jsonl", OUTCOMES_FILE, "committed.json", NODE_PARTITIONS_FILE,
             CANARIES_FILE, UPDATE_CANARIES_FILE)
# Attack outputs (reconstructions, MIA scores) larger than this stay on the machine: 70 points of
# 256 reconstructed images would weigh hundreds of MiB in the repository.
MAX_OUTPUT_BYTES = 1 << 20
LEFT_OUT = "checkpoints, recording and clients' state (what resuming and replaying need), and attack outputs over 1 MiB"


def _copy_atomically(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)


def _starts(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()).get("starts", []) if path.is_file() else []


def merge_stamp(source: Path, target: Path) -> None:
    """`target`'s sweep.json gains the starts of `source`'s that it lacks, so the report's
    provenance names every machine and commit."""
    source_stamp, target_stamp = source / SWEEP_STAMP, target / SWEEP_STAMP
    if not source_stamp.is_file():
        return
    target.mkdir(parents=True, exist_ok=True)
    # Two sweep processes (`--points` parts) may archive at once: one merge at a time, so
    # neither's start is lost.
    with open(target / ".sweep.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ours = _starts(target_stamp)
        seen = {json.dumps(start, sort_keys=True) for start in ours}
        theirs = [start for start in _starts(source_stamp) if json.dumps(start, sort_keys=True) not in seen]
        head = json.loads(source_stamp.read_text())
        # In the order they were made (both sort as times; "started" is the finer).
        merged = sorted([*ours, *theirs], key=lambda start: (start.get("measured", ""), start.get("started", "")))
        write_json_atomically(target_stamp, {**head, "starts": merged})


def archived_attacks(archive: Path, point: str) -> set[str]:
    """The attack labels whose results the archive holds for the point."""
    folder = archive / "runs" / point / ATTACK_FOLDER
    return {path.stem for path in folder.glob("*.json")} if folder.is_dir() else set()


def archived_state(archive: Path, point: str) -> str | None:
    """The archived run's state ("finished", ...), None when the archive does not hold it."""
    status = archive / "runs" / point / "status.json"
    if not (archive / "runs" / point / ARCHIVE_MARKER).is_file() or not status.is_file():
        return None
    return json.loads(status.read_text()).get("state")


def archive_point(sweep_folder: Path, point: str, archive: Path) -> None:
    """Copy the point's record and its run folder's results into the archive (each file
    replaced atomically, so an archive interrupted mid-copy holds every file whole)."""
    run = sweep_folder / "runs" / point
    target = archive / "runs" / point
    for name in RUN_FILES:
        if (run / name).is_file():
            _copy_atomically(run / name, target / name)
    attacks = run / ATTACK_FOLDER
    for path in sorted(attacks.iterdir()) if attacks.is_dir() else []:
        if path.suffix == ".json" or (path.suffix == ".safetensors" and path.stat().st_size <= MAX_OUTPUT_BYTES):
            _copy_atomically(path, target / ATTACK_FOLDER / path.name)
    record = sweep_folder / "points" / f"{point}.json"
    if record.is_file():
        _copy_atomically(record, archive / "points" / record.name)
    write_json_atomically(target / ARCHIVE_MARKER, {"archived": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                            "sweep_folder": str(sweep_folder), "left_out": LEFT_OUT})
    merge_stamp(sweep_folder, archive)


def _relocated(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old):]
    return value


def restore_point(archive: Path, point: str, sweep_folder: Path) -> None:
    """Copy an archived point into the sweep folder. Paths inside the sweep folder the archive
    was made from (output.root, the prepared artefacts) are rewritten to this one, so the point
    compares equal to its config here."""
    source = archive / "runs" / point
    old = json.loads((source / ARCHIVE_MARKER).read_text())["sweep_folder"]
    new = str(sweep_folder)
    run = sweep_folder / "runs" / point
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        _copy_atomically(path, run / path.relative_to(source))
    written = json.loads((run / "config.json").read_text())
    written["config"] = {key: _relocated(value, old, new) for key, value in written["config"].items()}
    write_json_atomically(run / "config.json", written)
    record = archive / "points" / f"{point}.json"
    if record.is_file():
        data = json.loads(record.read_text())
        data["overrides"] = {key: _relocated(value, old, new) for key, value in data.get("overrides", {}).items()}
        target = sweep_folder / "points" / record.name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomically(target, data)


def restorable(archive: Path, point: str, attacks: Iterable[str]) -> bool:
    """Whether the archive holds the point finished with every one of `attacks` (a point it
    holds only in part runs again: its missing attacks need the run's recording)."""
    return archived_state(archive, point) == "finished" and set(attacks) <= archived_attacks(archive, point)
