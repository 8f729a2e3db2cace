"""The protocol module is the one place transfer kinds and tensor names are spelled.

Runs of every paradigm must only send and receive what training.protocol names (and so
what the recorder accepts), and no quoted kind or tensor name may be left elsewhere.
"""

import ast
from pathlib import Path

import pytest

from attacks.recording import Recorder
from clients.app import app as client_app
from config import load_config
from sims.inprocess import InProcessGrid
from strategies.app import run
from training import protocol
from wire import Wire

ROOT = Path(__file__).parents[2]
TENSOR_NAMES = {protocol.ROWS, protocol.LENGTHS, protocol.GRAD, protocol.ANSWERS, protocol.ANSWER_LENGTHS, protocol.TOKENS}


def test_a_kind_gives_the_wire_its_expectation_for_a_hidden_size():
    assert protocol.ACTIVATION_AT_CA.expectation(hidden=8) == {
        protocol.ROWS: ((None, 8), "float"), protocol.LENGTHS: ((None,), "index")
    }
    assert protocol.GRADIENT_AT_CB.expectation(rows=5, hidden=8) == {protocol.GRAD: ((5, 8), "float")}
    assert protocol.END_OF_TURN.expectation() == {}
    assert protocol.ADAPTER_UPDATE.expectation(adapter_shapes={"w": (2, 3)}) == {"w": ((2, 3), "float")}
    with pytest.raises(ValueError, match=r"'grad' needs the size\(s\) \['rows'\]"):
        protocol.GRADIENT_AT_CB.expectation(hidden=8)
    with pytest.raises(ValueError, match="adapter_shapes"):
        protocol.GLOBAL_ADAPTERS.expectation()
    with pytest.raises(ValueError, match="'activation at CQ' is not in the protocol.*'activation at CA'"):
        protocol.kind("activation at CQ")


class WatchedGrid(InProcessGrid):
    """An in-process grid that notes every message type it delivers and the tensors it carries."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.messages: list[tuple[str, set[str]]] = []

    def deliver(self, message):
        content = message.content
        key = protocol.ARRAYS if protocol.ARRAYS in content.array_records else protocol.TENSORS
        names = set(content.array_records[key].keys()) if key in content.array_records else set()
        self.messages.append((message.metadata.message_type, names))
        return super().deliver(message)


@pytest.mark.parametrize("paradigm", ["cl", "fl", "sl", "usl"])
def test_every_kind_a_run_sends_or_receives_is_in_the_protocol_and_recordable(paradigm, run_config, tmp_path, monkeypatch):
    count = 1 if paradigm == "cl" else 2
    raw = run_config(paradigm=paradigm, **{"clients.count": count, "eval.every": 1})
    seen: list[tuple[str, str]] = []  # (kind, direction) as the wire was told
    received, sent = Wire.received, Wire.sent

    def watch_received(self, round_, client, kind, *args, **kwargs):
        seen.append((kind, "up"))
        return received(self, round_, client, kind, *args, **kwargs)

    def watch_sent(self, round_, client, content, *, kind=None, **kwargs):
        if kind is not None:
            seen.append((kind, "down"))
        return sent(self, round_, client, content, kind=kind, **kwargs)

    monkeypatch.setattr(Wire, "received", watch_received)
    monkeypatch.setattr(Wire, "sent", watch_sent)
    grid = WatchedGrid(client_app, raw, count)
    folder = run(grid, load_config(raw))
    assert (folder.path / "status.json").read_text().count('"finished"') == 1

    assert seen
    recorder = Recorder(tmp_path / "recording")
    for kind, direction in seen:
        assert protocol.kind(kind).direction == direction
        recorder.record(1, 1, kind, {}, direction=direction)  # refuses a kind the protocol does not know
    for message_type, names in grid.messages:
        assert message_type in protocol.MESSAGE_TYPES, message_type
        carried = protocol.CARRIES.get(message_type)
        if carried is None:
            assert names == set(), message_type
        elif not carried.adapters:  # an adapter set's names are the model's
            assert names == carried.tensor_names, message_type


def _quoted_names(path: Path) -> list[tuple[int, str]]:
    """Kind names anywhere, and tensor names used as keys, subscripts or call arguments, spelled as literals."""
    found = []
    kinds = set(protocol.KINDS)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in kinds:
            found.append((node.lineno, node.value))
        if isinstance(node, ast.Dict):
            keys = node.keys
        elif isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call):
            keys = node.args
        else:
            keys = []
        found += [(k.lineno, k.value) for k in keys if isinstance(k, ast.Constant) and k.value in TENSOR_NAMES]
    return found


def test_no_kind_or_tensor_name_is_spelled_outside_the_protocol():
    spelled = {
        f"{path.relative_to(ROOT)}:{line}": name
        for package in ("strategies", "clients", "attacks", "sims")
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in _quoted_names(path)
    }
    assert spelled == {}
