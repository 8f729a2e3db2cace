"""The wire: the one way a tensor leaves a party.

Both clients/ and strategies/ import it, so it lives outside both. Everything that
crosses a cut (activations, their gradients) or carries an update (FL's LoRA
weights) is encoded here under the run's dtype policy, its serialised bytes are
counted per direction, round and client, and observers see exactly what the server
received, decoded as the server decoded it (and, when they ask, the payloads it sent
that a strategy names).
"""

from wire.wire import (
    WIRE_DTYPES,
    Ledger,
    Transfer,
    TransferObserver,
    Wire,
    WireError,
    numpy_record,
    numpy_tensors,
    pack_rows,
    serialized_size,
    unpack_rows,
)

__all__ = [
    "WIRE_DTYPES",
    "Ledger",
    "Transfer",
    "TransferObserver",
    "Wire",
    "WireError",
    "numpy_record",
    "numpy_tensors",
    "pack_rows",
    "serialized_size",
    "unpack_rows",
]
