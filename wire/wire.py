"""Encoding, accounting and observation of every tensor that crosses a party boundary.

Tensors travel as raw little-endian bytes in Flower `Array`s (stype "torch.raw"):
numpy cannot hold bfloat16, and the .npy header would add 128 bytes per array for
nothing. Hidden states and their gradients travel packed — only the rows of real
tokens, plus each sample's length — so padding never crosses a cut and the payload
is k × D × bytes-per-element plus a few bytes per sample.

The server keeps the ledger because it sees both directions of every exchange; a
client only encodes and decodes.
"""

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from flwr.app import Array, ArrayRecord, RecordDict

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INDEX_DTYPE = torch.int32
RAW_STYPE = "torch.raw"
DIRECTIONS = ("up", "down")  # up: client -> server, down: server -> client
_TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (*WIRE_DTYPES.values(), INDEX_DTYPE)}

# An expected tensor: its shape (None where any size is allowed) and "float" or "index".
Expectation = tuple[tuple[int | None, ...], str]


class WireError(ValueError):
    """A payload that must not be folded into the model: wrong names, shapes, dtypes or values."""


def serialized_size(obj: object) -> int:
    """Bytes Flower serialises for a record tree: the object itself plus every child object."""
    children = obj.children or {}
    return len(obj.deflate()) + sum(serialized_size(child) for child in children.values())


def numpy_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Tensors as fp32 numpy Arrays: what Flower's strategies and DP pieces compute on (FedAvg's
    average, clipping, noise) on either side of the wire, which carries them in its own dtype."""
    return ArrayRecord({name: Array(tensor.detach().float().cpu().numpy()) for name, tensor in tensors.items()})


def numpy_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The inverse of `numpy_record`."""
    return {name: torch.from_numpy(array.numpy()) for name, array in record.items()}


def pack_rows(hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, D] states and their 2D mask -> the real tokens' rows [n, D] and per-sample lengths [B]."""
    return hidden[attention_mask.bool()], attention_mask.sum(-1).to(INDEX_DTYPE)


def unpack_rows(rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_rows for left-padded batches: (hidden [B, T, D], mask, positions).

    Padded slots come back as zeros: no real token attends to them, so real tokens'
    outputs are unchanged. Differentiable in `rows`, so the gradient of the packed
    rows is the packed gradient.
    """
    lengths = lengths.to(torch.long)
    batch, width = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
    slots = torch.arange(width, device=rows.device)
    attention_mask = (slots.unsqueeze(0) >= (width - lengths.to(rows.device)).unsqueeze(1)).to(torch.long)
    hidden = rows.new_zeros(batch, width, rows.shape[-1]).index_put((attention_mask.bool(),), rows)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return hidden, attention_mask, position_ids


@dataclass(frozen=True)
class Transfer:
    """One payload the server received, as the server decoded it ("up"), or sent, as its
    client will decode it ("down")."""

    round: int
    client: int
    kind: str
    tensors: Mapping[str, torch.Tensor]
    num_bytes: int
    direction: str = "up"


TransferObserver = Callable[[Transfer], None]


@dataclass
class Ledger:
    """Serialised bytes per (round, client, direction)."""

    bytes: dict[tuple[int, int, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, round_: int, client: int, direction: str, num_bytes: int) -> None:
        self.bytes[round_, client, direction] += num_bytes

    def round_totals(self, round_: int) -> dict[str, int]:
        totals = {f"bytes_{direction}": 0 for direction in DIRECTIONS}
        for (r, _, direction), value in self.bytes.items():
            if r == round_:
                totals[f"bytes_{direction}"] += value
        return totals

    def per_client(self, round_: int) -> dict[str, dict[str, int]]:
        clients: dict[str, dict[str, int]] = defaultdict(lambda: {d: 0 for d in DIRECTIONS})
        for (r, client, direction), value in self.bytes.items():
            if r == round_:
                clients[str(client)][direction] += value
        return dict(clients)


class Wire:
    """Dtype policy, byte ledger and observers of one party's side of the wire."""

    def __init__(self, dtype: str = "fp32") -> None:
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype={dtype!r}; allowed: {sorted(WIRE_DTYPES)}")
        self.dtype_name = dtype
        self.dtype = WIRE_DTYPES[dtype]
        self.ledger = Ledger()
        self._observers: list[TransferObserver] = []
        self._sent_observers: list[TransferObserver] = []

    # -- encoding (both parties) ---------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
        """Floating tensors in the wire dtype, integer tensors as int32, both as raw bytes."""
        record = ArrayRecord()
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            tensor = tensor.to(self.dtype) if tensor.is_floating_point() else tensor.to(INDEX_DTYPE)
            tensor = tensor.cpu().contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            record[name] = Array(
                dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape), stype=RAW_STYPE, data=data
            )
        return record

    def decode(self, record: ArrayRecord, expected: Mapping[str, Expectation], *, what: str) -> dict[str, torch.Tensor]:
        """Tensors of `record`, after checking names, dtypes, shapes and finiteness against `expected`."""
        names, wanted = set(record.keys()), set(expected)
        if names != wanted:
            raise WireError(
                f"{what}: payload holds tensors {sorted(names)}, expected exactly {sorted(wanted)}"
            )
        tensors = {}
        for name, (shape, kind) in expected.items():
            array = record[name]
            want_dtype = self.dtype if kind == "float" else INDEX_DTYPE
            dtype = _TORCH_DTYPES.get(array.dtype)
            if array.stype != RAW_STYPE or dtype != want_dtype:
                raise WireError(
                    f"{what}: tensor {name!r} has dtype {array.dtype!r} (stype {array.stype!r}); the wire policy "
                    f"requires {str(want_dtype).removeprefix('torch.')!r} ({RAW_STYPE!r})"
                )
            got = tuple(array.shape)
            if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got, strict=False)):
                allowed = tuple("*" if w is None else w for w in shape)
                raise WireError(f"{what}: tensor {name!r} has shape {got}, expected {allowed}")
            if len(array.data) != dtype.itemsize * _numel(got):
                raise WireError(
                    f"{what}: tensor {name!r} carries {len(array.data)} bytes for shape {got} of {array.dtype}"
                )
            tensor = _raw_tensor(array)
            if kind == "float" and not torch.isfinite(tensor).all():
                bad = int((~torch.isfinite(tensor)).sum())
                raise WireError(f"{what}: tensor {name!r} holds {bad} non-finite values (NaN or inf)")
            tensors[name] = tensor
        return tensors

    # -- the server's side: accounting and observation --------------------------------------
    def subscribe(self, observer: TransferObserver, *, sent: bool = False) -> None:
        """Call `observer` with every payload the server accepts, exactly as it decoded it;
        with `sent`, also with every payload the server sends under a name (see `sent`)."""
        self._observers.append(observer)
        if sent:
            self._sent_observers.append(observer)

    def sent(
        self, round_: int, client: int, content: RecordDict, *, kind: str | None = None, record_key: str = "wire"
    ) -> int:
        """Count a message the server sends; returns its serialised content size.

        A strategy names (`kind`) only the payloads an attack replays (the USL rows at CB,
        FL's global adapters); observers subscribed with `sent=True` see those tensors as
        the client will decode them.
        """
        num_bytes = serialized_size(content)
        self.ledger.add(round_, client, "down", num_bytes)
        if kind is not None and self._sent_observers:
            tensors = {name: _raw_tensor(array) for name, array in content.array_records[record_key].items()}
            transfer = Transfer(round_, client, kind, tensors, num_bytes, direction="down")
            for observer in self._sent_observers:
                observer(transfer)
        return num_bytes

    def show(self, transfer: Transfer) -> None:
        """Show the observers a payload the server received in a form the wire does not decode
        (SecAgg+'s masked vectors, strategies.secagg); its bytes are the caller's to count."""
        for observer in self._observers:
            observer(transfer)

    def received(
        self,
        round_: int,
        client: int,
        kind: str,
        content: RecordDict,
        expected: Mapping[str, Expectation],
        *,
        record_key: str = "wire",
        check: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Count, decode and check a reply's tensors, then show them to the observers.

        `check` adds the receiver's consistency rules (raising WireError). The bytes
        count even when the payload is rejected (they did cross the wire); observers
        see only accepted payloads, i.e. what the server went on to use.
        """
        num_bytes = serialized_size(content)
        self.ledger.add(round_, client, "up", num_bytes)
        if record_key not in content.array_records:
            raise WireError(f"{kind} from client {client}: the reply carries no {record_key!r} tensors")
        tensors = self.decode(content.array_records[record_key], expected, what=f"{kind} from client {client}")
        if check is not None:
            check(tensors)
        transfer = Transfer(round=round_, client=client, kind=kind, tensors=tensors, num_bytes=num_bytes)
        for observer in self._observers:
            observer(transfer)
        return tensors


def _raw_tensor(array: Array) -> torch.Tensor:
    """The tensor an `encode`d Array holds (a copy: Flower's buffer is read-only)."""
    dtype, shape = _TORCH_DTYPES[array.dtype], tuple(array.shape)
    if not array.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(array.data), dtype=torch.uint8).view(dtype).reshape(shape)


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
