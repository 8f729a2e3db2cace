"""What the server saw, on disk: the input of every attack.

A recording is a folder (by default `<run folder>/recording/`):

- `recording.json`: format version, the cap, and the run's flat config (paradigm,
  profile, cuts, pruning policy, ...), so an attack knows what it is looking at;
- `index.jsonl`: one line per transfer the server received (or, when the protocol
  marks it replayed, sent): `seq`, `round`, `client`, `kind` (the name of a
  training.protocol kind, e.g. "activation at CA"), `direction` ("up": client -> server, "down": server -> client),
  `occurrence` (how many transfers of this client, kind and direction came before
  it in the same round — with the round, this locates a split client's step),
  `num_bytes` (serialised size), `tensor_bytes` (what storing it costs), `samples`, `tensors` (name -> shape, dtype), and
  `file` (null when the cap left the tensors out);
- `transfers/<seq>.safetensors`: the tensors, exactly as the server decoded them
  (wire dtype kept).

Every transfer gets an index line; only tensors count against the cap, and storing
stops at the first transfer that does not fit, so what is stored is always a prefix
of the run. A resumed run drops what was recorded after its last committed round,
because those rounds are run again.
"""

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from training import protocol
from training.defenses import describe_defenses, describe_dp
from wire.wire import DIRECTIONS, Transfer

FORMAT_VERSION = 1
RECORDING_FOLDER = "recording"
HEADER_FILE = "recording.json"
INDEX_FILE = "index.jsonl"
TENSOR_FOLDER = "transfers"
DEFAULT_MAX_BYTES = 2 * 1024**3

log = logging.getLogger(__name__)


class MissingObservationError(LookupError):
    """A recording lacks what an attack needs; the message names what is missing and what is there."""


@dataclass(frozen=True)
class RecordedTransfer:
    seq: int
    round: int
    client: int
    kind: str
    direction: str
    occurrence: int
    num_bytes: int
    tensor_bytes: int
    samples: int
    tensors: dict[str, dict[str, Any]]
    file: str | None

    @property
    def stored(self) -> bool:
        return self.file is not None


def _samples_in(tensors: Mapping[str, torch.Tensor]) -> int:
    """Samples a payload carries: one per packed length, else one."""
    lengths = tensors.get(protocol.LENGTHS)
    return int(lengths.numel()) if lengths is not None else 1


def _read_index(path: Path) -> list[RecordedTransfer]:
    """The index's entries. Its last line may be torn by a kill mid-append (a transfer of a round
    that never committed): dropped with a warning naming the file. A torn line before it is damage."""
    if not path.exists():
        return []
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    entries = []
    for position, (number, line) in enumerate(lines):
        try:
            entries.append(RecordedTransfer(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as error:
            if position < len(lines) - 1:
                raise ValueError(f"{path} line {number} is damaged ({error}); the recording cannot be read") from None
            log.warning("%s line %d is torn (a kill mid-write); dropped", path, number)
    return entries


class Recorder:
    """A wire observer that writes what the server received into a recording, up to a cap.

    A run records itself under `threat.model` passive or active-fsha (strategies.adversarial),
    which subscribes it with `Wire.subscribe(recorder, sent=True)`: it then also gets what the
    server *sent* and the strategy names (FL's global adapters, USL's activation at CB),
    recorded with direction "down". `Recorder.factory(...)` makes one for a run folder.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_samples: int | None = None,
        kinds: Collection[str] | None = None,
        rounds: Collection[int] | None = None,
        committed_round: int = 0,
        header: Mapping[str, Any] | None = None,
    ) -> None:
        if max_bytes < 0 or (max_samples is not None and max_samples < 0):
            raise ValueError(f"recording caps must be >= 0, got max_bytes={max_bytes}, max_samples={max_samples}")
        self.folder = Path(folder)
        self.max_bytes, self.max_samples = max_bytes, max_samples
        self.kinds = None if kinds is None else frozenset(kinds)
        self.rounds = None if rounds is None else frozenset(rounds)
        (self.folder / TENSOR_FOLDER).mkdir(parents=True, exist_ok=True)
        kept = [entry for entry in _read_index(self.folder / INDEX_FILE) if entry.round <= committed_round]
        self._drop_files_not_in(kept)
        self._write_index(kept)
        self._write_header(header or {})
        self.next_seq = max((entry.seq for entry in kept), default=-1) + 1
        # The caps hold over the whole recording, or per listed round when `rounds` are given.
        self.stored_bytes: Counter = Counter()
        self.stored_samples: Counter = Counter()
        self.full: set[int | None] = set()
        for entry in kept:
            if entry.stored:
                self.stored_bytes[self._bucket(entry.round)] += entry.tensor_bytes
                self.stored_samples[self._bucket(entry.round)] += entry.samples
            elif entry.tensors and self._wanted(entry.kind, entry.round):
                self.full.add(self._bucket(entry.round))
        self.occurrences = Counter((e.round, e.client, e.kind, e.direction) for e in kept)

    @classmethod
    def factory(cls, **cap: Any) -> Callable[[Any, Any], "Recorder"]:
        """An OBSERVER_FACTORIES entry: a recorder in the run folder, headed by the run config and
        the defenses its clients applied to what it records."""

        def make(config: Any, run_folder: Any) -> Recorder:
            return cls(
                Path(run_folder.path) / RECORDING_FOLDER,
                committed_round=run_folder.committed_round(),
                header={"config": config.to_flat(), "defenses": describe_defenses(config), "dp": describe_dp(config)},
                **cap,
            )

        return make

    def __call__(self, transfer: Transfer) -> None:
        self.record(transfer.round, transfer.client, transfer.kind, transfer.tensors,
                    direction=transfer.direction, num_bytes=transfer.num_bytes)

    def record(
        self,
        round_: int,
        client: int,
        kind: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        direction: str = "up",
        num_bytes: int | None = None,
    ) -> RecordedTransfer:
        """File one transfer; a kind the protocol does not know, or one travelling the wrong way, is
        refused (attacks select transfers by these names, so a stray name would go unseen)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r}; allowed: {DIRECTIONS}")
        known = protocol.kind(kind)
        if known.direction != direction:
            raise ValueError(f"transfer kind {kind!r} travels {known.direction!r} by the protocol, not {direction!r}")
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        samples = _samples_in(tensors)
        key = (round_, client, kind, direction)
        file = None
        bucket = self._bucket(round_)
        if tensors and self._wanted(kind, round_) and bucket not in self.full:
            fits = self.stored_bytes[bucket] + size <= self.max_bytes and (
                self.max_samples is None or self.stored_samples[bucket] + samples <= self.max_samples
            )
            if fits:
                file = f"{TENSOR_FOLDER}/{self.next_seq:08d}.safetensors"
                partial = self.folder / (file + ".partial")
                save_file(tensors, str(partial))
                os.replace(partial, self.folder / file)
                self.stored_bytes[bucket] += size
                self.stored_samples[bucket] += samples
            else:
                self.full.add(bucket)
        entry = RecordedTransfer(
            seq=self.next_seq,
            round=round_,
            client=client,
            kind=kind,
            direction=direction,
            occurrence=self.occurrences[key],
            num_bytes=size if num_bytes is None else num_bytes,
            tensor_bytes=size,
            samples=samples,
            tensors={n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in tensors.items()},
            file=file,
        )
        self.occurrences[key] += 1
        self.next_seq += 1
        with (self.folder / INDEX_FILE).open("a") as handle:
            handle.write(json.dumps(asdict(entry)) + "\n")
        return entry

    # -- internals -------------------------------------------------------------------------
    def _wanted(self, kind: str, round_: int) -> bool:
        return (self.kinds is None or kind in self.kinds) and (self.rounds is None or round_ in self.rounds)

    def _bucket(self, round_: int) -> int | None:
        """Which cap a round's transfers count against: their round's when rounds are listed."""
        return None if self.rounds is None else round_

    def _drop_files_not_in(self, kept: Iterable[RecordedTransfer]) -> None:
        keep = {entry.file for entry in kept if entry.file}
        for path in (self.folder / TENSOR_FOLDER).iterdir():
            if f"{TENSOR_FOLDER}/{path.name}" not in keep:
                path.unlink()

    def _write_index(self, entries: list[RecordedTransfer]) -> None:
        partial = self.folder / (INDEX_FILE + ".partial")
        partial.write_text("".join(json.dumps(asdict(e)) + "\n" for e in entries))
        os.replace(partial, self.folder / INDEX_FILE)

    def _write_header(self, header: Mapping[str, Any]) -> None:
        content = {
            "format": FORMAT_VERSION,
            "cap": {"max_bytes": self.max_bytes, "max_samples": self.max_samples,
                    "kinds": None if self.kinds is None else sorted(self.kinds),
                    "rounds": None if self.rounds is None else sorted(self.rounds)},
            **header,
        }
        (self.folder / HEADER_FILE).write_text(json.dumps(content, indent=2, sort_keys=True))


@dataclass
class Recording:
    """A recording read back: its header, its index, and the stored tensors on demand."""

    folder: Path
    header: dict[str, Any]
    entries: list[RecordedTransfer] = field(default_factory=list)

    @classmethod
    def open(cls, path: str | Path) -> "Recording":
        """A recording folder, or a run folder holding one."""
        folder = Path(path)
        if not (folder / HEADER_FILE).exists() and (folder / RECORDING_FOLDER / HEADER_FILE).exists():
            folder = folder / RECORDING_FOLDER
        if not (folder / HEADER_FILE).exists():
            raise FileNotFoundError(
                f"{path} is neither a recording ({HEADER_FILE} missing) nor a run folder with a "
                f"{RECORDING_FOLDER}/ inside; record a run with threat.model=\"passive\" (or \"active-fsha\")"
            )
        header = json.loads((folder / HEADER_FILE).read_text())
        if header.get("format") != FORMAT_VERSION:
            raise ValueError(f"{folder} is recording format {header.get('format')}, this code reads {FORMAT_VERSION}")
        return cls(folder, header, _read_index(folder / INDEX_FILE))

    @property
    def config(self) -> dict[str, Any]:
        """The run's flat config (empty for recordings made outside a run)."""
        return self.header.get("config", {})

    def tensors(self, entry: RecordedTransfer) -> dict[str, torch.Tensor]:
        if entry.file is None:
            raise MissingObservationError(
                f"transfer {entry.seq} ({entry.kind!r}, round {entry.round}, client {entry.client}) was indexed "
                f"but not stored: the recording's cap ({self.header.get('cap')}) was reached"
            )
        return load_file(str(self.folder / entry.file))

    def at_round(self, round_: int) -> "Recording":
        """The same recording with only round `round_`'s transfers: what an attack replayed at that
        point of training reads. A round that stored nothing is refused, naming those that did."""
        entries = [entry for entry in self.entries if entry.round == round_]
        if not any(entry.stored for entry in entries):
            stored = sorted({entry.round for entry in self.entries if entry.stored})
            raise MissingObservationError(
                f"{self.folder} stored no transfer of round {round_}; rounds stored: {stored or 'none'} "
                "(threat.record_rounds lists the rounds a run stores, each under the caps)"
            )
        return replace(self, entries=entries)

    def select(self, kind: str, direction: str = "up", *, stored_only: bool = True) -> list[RecordedTransfer]:
        return [
            e for e in self.entries
            if e.kind == kind and e.direction == direction and (e.stored or not stored_only)
        ]

    def require(self, kind: str, direction: str = "up", *, attack: str) -> list[RecordedTransfer]:
        """The stored transfers of `kind`; a clear error when there are none."""
        found = self.select(kind, direction)
        if found:
            return found
        present = sorted(Counter(f"{e.kind!r} ({e.direction}, {'stored' if e.stored else 'index only'})"
                                 for e in self.entries).items())
        listing = ", ".join(f"{name} ×{count}" for name, count in present) or "nothing"
        raise MissingObservationError(
            f"{attack} needs stored {kind!r} transfers (direction {direction!r}); {self.folder} holds {listing}"
        )

    def first_cut_kind(self, *, attack: str) -> str:
        """The name of the first cut's activation for this recording's paradigm."""
        paradigm = self.config.get("paradigm")
        if paradigm in protocol.FIRST_CUT_ACTIVATION:
            return protocol.FIRST_CUT_ACTIVATION[paradigm].name
        present = {e.kind for e in self.entries}
        found = [kind.name for kind in protocol.FIRST_CUT_ACTIVATION.values() if kind.name in present]
        if len(found) == 1:
            return found[0]
        raise MissingObservationError(
            f"{attack} reads the activation at the first cut, which only SL and USL runs send; this recording "
            f"is paradigm {paradigm!r} with transfers {sorted(present) or 'none'}"
        )

    def partner(self, entry: RecordedTransfer, kind: str, direction: str = "up") -> RecordedTransfer | None:
        """The stored transfer of `kind` from the same round, client and step as `entry`."""
        for other in self.entries:
            if (other.round, other.client, other.occurrence, other.kind, other.direction) == (
                entry.round, entry.client, entry.occurrence, kind, direction
            ) and other.stored:
                return other
        return None
