"""The wire: dtype policy, exact byte accounting, packing, validation and observers."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from wire import WIRE_DTYPES, Wire, WireError, pack_rows, serialized_size, unpack_rows

EXPECT = {"rows": ((None, 16), "float"), "lengths": ((None,), "index")}


def left_padded(lengths, width=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(lengths), max(lengths), width, generator=generator)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, max(lengths) - n :] = 1
    return hidden, mask


def test_packing_keeps_only_real_tokens_and_round_trips():
    hidden, mask = left_padded([5, 3, 7])
    rows, lengths = pack_rows(hidden, mask)
    assert rows.shape == (15, 16) and lengths.tolist() == [5, 3, 7]
    back, back_mask, positions = unpack_rows(rows, lengths)
    torch.testing.assert_close(back_mask, mask, rtol=0, atol=0)
    torch.testing.assert_close(back[mask.bool()], hidden[mask.bool()], rtol=0, atol=0)
    assert (back[~mask.bool()] == 0).all()
    assert positions[1].tolist() == [0, 0, 0, 0, 0, 1, 2]


def test_the_gradient_of_packed_rows_is_the_packed_gradient():
    hidden, mask = left_padded([4, 2])
    rows = pack_rows(hidden, mask)[0].requires_grad_()
    weights = torch.randn_like(hidden)
    (unpack_rows(rows, mask.sum(-1))[0] * weights).sum().backward()
    torch.testing.assert_close(rows.grad, pack_rows(weights, mask)[0], rtol=0, atol=0)


@pytest.mark.parametrize("policy", sorted(WIRE_DTYPES))
def test_floats_travel_in_the_policy_dtype_and_bytes_are_k_d_bpe_plus_little(policy):
    wire = Wire(policy)
    hidden, mask = left_padded([30, 20, 25], width=64)
    rows, lengths = pack_rows(hidden, mask)
    content = RecordDict({"wire": wire.encode({"rows": rows, "lengths": lengths}), "config": ConfigRecord({"round": 1})})
    decoded = wire.received(1, 7, "activation", content, {"rows": ((None, 64), "float"), "lengths": ((None,), "index")})
    assert decoded["rows"].dtype == WIRE_DTYPES[policy]
    torch.testing.assert_close(decoded["rows"], rows.to(WIRE_DTYPES[policy]), rtol=0, atol=0)
    theoretical = 75 * 64 * WIRE_DTYPES[policy].itemsize
    counted = wire.ledger.round_totals(1)["bytes_up"]
    assert counted == serialized_size(content)
    # Lengths (3 × int32) plus a fixed ~1 kB of record structure per message (object ids, names, metadata).
    assert 0 < counted - theoretical - 3 * 4 < 1100
    large = RecordDict({"wire": wire.encode(dict(zip(("rows", "lengths"), pack_rows(*left_padded([600] * 8, 256)))))})
    assert serialized_size(large) < 600 * 8 * 256 * WIRE_DTYPES[policy].itemsize * 1.01


def test_the_ledger_separates_rounds_clients_and_directions():
    wire = Wire()
    content = RecordDict({"wire": wire.encode({"x": torch.ones(10)})})
    wire.sent(1, 1, content)
    wire.sent(1, 2, content)
    wire.sent(2, 1, content)
    size = serialized_size(content)
    assert wire.ledger.round_totals(1) == {"bytes_up": 0, "bytes_down": 2 * size}
    assert wire.ledger.per_client(1) == {"1": {"up": 0, "down": size}, "2": {"up": 0, "down": size}}


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"rows": torch.ones(3, 15), "lengths": torch.tensor([3])}, r"shape \(3, 15\), expected \('\*', 16\)"),
        ({"rows": torch.ones(3, 16)}, r"expected exactly \['lengths', 'rows'\]"),
        ({"rows": torch.full((3, 16), float("inf")), "lengths": torch.tensor([3])}, "48 non-finite"),
    ],
)
def test_malformed_payloads_are_rejected_with_the_reason(tensors, message):
    wire = Wire()
    content = RecordDict({"wire": wire.encode(tensors)})
    with pytest.raises(WireError, match=message):
        wire.received(1, 3, "activation", content, EXPECT)


def test_a_payload_in_another_dtype_than_the_policy_is_rejected():
    content = RecordDict({"wire": Wire("fp16").encode({"rows": torch.ones(2, 16), "lengths": torch.tensor([2])})})
    with pytest.raises(WireError, match="dtype 'float16'.*requires 'float32'"):
        Wire("fp32").received(1, 3, "activation", content, EXPECT)


def test_a_numpy_array_instead_of_raw_bytes_is_rejected():
    import numpy as np

    record = ArrayRecord({"rows": __import__("flwr.app", fromlist=["Array"]).Array(np.ones((2, 16), np.float32)),
                          "lengths": Wire().encode({"l": torch.tensor([2])})["l"]})
    with pytest.raises(WireError, match="stype"):
        Wire().decode(record, EXPECT, what="activation")


def test_observers_see_exactly_what_the_server_accepted():
    wire = Wire("bf16")
    seen = []
    wire.subscribe(seen.append)
    rows = torch.randn(4, 16)
    good = RecordDict({"wire": wire.encode({"rows": rows, "lengths": torch.tensor([4])})})
    bad = RecordDict({"wire": wire.encode({"rows": torch.full((4, 16), float("nan")), "lengths": torch.tensor([4])})})
    wire.received(2, 5, "activation at CA", good, EXPECT)
    with pytest.raises(WireError):
        wire.received(2, 5, "activation at CA", bad, EXPECT)
    (transfer,) = seen
    assert (transfer.round, transfer.client, transfer.kind) == (2, 5, "activation at CA")
    assert transfer.num_bytes == serialized_size(good)
    assert transfer.tensors["rows"].dtype == torch.bfloat16
    torch.testing.assert_close(transfer.tensors["rows"], rows.to(torch.bfloat16), rtol=0, atol=0)
    assert wire.ledger.round_totals(2)["bytes_up"] == serialized_size(good) + serialized_size(bad)


def test_observers_that_ask_see_the_named_payloads_the_server_sent_as_the_client_decodes_them():
    wire = Wire("bf16")
    received_only, everything = [], []
    wire.subscribe(received_only.append)
    wire.subscribe(everything.append, sent=True)
    rows = torch.randn(4, 16)
    named = RecordDict({"wire": wire.encode({"rows": rows})})
    wire.sent(3, 7, named, kind="activation at CB")
    wire.sent(3, 7, RecordDict({"wire": wire.encode({"grad": rows})}))  # unnamed: counted, not shown
    assert received_only == []
    (transfer,) = everything
    assert (transfer.round, transfer.client, transfer.kind, transfer.direction) == (3, 7, "activation at CB", "down")
    assert transfer.num_bytes == serialized_size(named)
    client_side = Wire("bf16").decode(named["wire"], {"rows": ((4, 16), "float")}, what="rows at CB")
    torch.testing.assert_close(transfer.tensors["rows"], client_side["rows"], rtol=0, atol=0)
