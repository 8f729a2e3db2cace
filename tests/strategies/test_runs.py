"""Whole runs of every paradigm through Flower messages: records, round trips, resume, faults."""

import json

import pytest
import torch
from flwr.app import Error, Message
from flwr.common.constant import SUPERLINK_NODE_ID

from clients.app import app as client_app
from config import load_config
from pruning import Selection
from sims.inprocess import InProcessGrid
from strategies.app import run
from strategies import split
from strategies.base import ServerFault
from strategies.fl import WireFedAvg
from training import protocol
from training.store import PrivateStore
from wire import Wire
from process_death import Killed, kill_in_round


def metrics(folder):
    return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]


def status(folder):
    return json.loads((folder.path / "status.json").read_text())


@pytest.mark.parametrize(
    ("paradigm", "trips_per_step"), [("usl", (2 * 2 + 1) / 2), ("sl", (2 + 1) / 2), ("fl", 1 / 2), ("cl", None)]
)
def test_a_run_records_every_round(paradigm, trips_per_step, run_config, fake_grid):
    count = 1 if paradigm == "cl" else 2
    raw = run_config(paradigm=paradigm, **{"clients.count": count, "train.rounds": 2, "train.steps_per_round": 2, "eval.every": 2})
    folder = run(fake_grid(client_app, raw, count), load_config(raw))
    records = metrics(folder)
    assert [r["round"] for r in records] == [1, 2]
    assert status(folder)["state"] == "finished"
    assert (status(folder)["complete"], status(folder)["failed_partitions"], status(folder)["test_share"]) == (True, {}, 1)
    assert all(r["train_loss"] > 0 and r["wall_s"] > 0 and r["faults"] == [] for r in records)
    assert "test_accuracy" not in records[0] and 0 <= records[1]["test_accuracy"] <= 1
    assert records[1]["test_count"] == 6
    if trips_per_step is not None:
        assert records[0]["round_trips_per_step"] == pytest.approx(trips_per_step)
    if paradigm != "cl":
        assert records[0]["bytes_up"] > 0 and records[0]["bytes_down"] > 0
        assert set(records[0]["bytes_per_client"]) == {"1", "2"}


def test_a_killed_run_resumes_without_losing_or_repeating_a_round(run_config, fake_grid, tmp_path):
    raw = run_config(**{"train.rounds": 3, "train.steps_per_round": 2})
    straight = run(fake_grid(client_app, {**raw, "output.name": "straight"}, 2), load_config({**raw, "output.name": "straight"}))

    grid = fake_grid(client_app, raw, 2)
    # At client 1's first head message of round 2, after it saved a half-done round.
    grid.interceptors[1] = kill_in_round(2, protocol.USL_HEAD)
    with pytest.raises(Killed):
        run(grid, load_config(raw))
    interrupted = json.loads((straight.path.parent / "run" / "status.json").read_text())
    assert interrupted["state"] == "failed" and interrupted["error_type"] == "Killed"

    resumed = run(fake_grid(client_app, raw, 2), load_config(raw))
    assert status(resumed)["state"] == "finished" and status(resumed)["resumed_from"] == 1
    assert [r["round"] for r in metrics(resumed)] == [1, 2, 3]
    for key in ("train_loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in metrics(resumed)] == [r[key] for r in metrics(straight)]
    got = torch.load(resumed.checkpoint_path(3), weights_only=True)["lora"]
    want = torch.load(straight.checkpoint_path(3), weights_only=True)["lora"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_a_resumed_run_refuses_a_changed_config_or_fewer_rounds(run_config, fake_grid):
    raw = run_config(**{"train.rounds": 2})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    changed = {**raw, "train.lr": 0.5}
    with pytest.raises(ValueError, match=r"changed: \['train.lr'\]"):
        run(fake_grid(client_app, changed, 2), load_config(changed))
    # Fewer rounds than the folder holds: refused, and the finished run's status left as it was.
    ended = status(folder)
    fewer = {**raw, "train.rounds": 1}
    with pytest.raises(ValueError, match=r"train.rounds=1 is not allowed; allowed: >= 2"):
        run(fake_grid(client_app, fewer, 2), load_config(fewer))
    assert status(folder) == ended


@pytest.mark.parametrize("paradigm", ["usl", "sl"])
def test_a_failing_client_loses_its_turn_and_the_reason_is_recorded(paradigm, run_config, fake_grid):
    raw = run_config(paradigm=paradigm, **{"train.steps_per_round": 2, "eval.every": 1})
    grid = fake_grid(client_app, raw, 2)

    def explode(message, reply):
        if message.metadata.message_type != protocol.SPLIT_BEGIN:
            raise RuntimeError("disk full on client 1")
        return reply

    grid.interceptors[1] = explode
    folder = run(grid, load_config(raw))
    record = metrics(folder)[0]
    assert record["steps"] == 2  # client 2's whole turn
    train, evaluate = record["faults"]
    assert train["client"] == 1 and "disk full on client 1" in train["reason"]
    assert train["consequence"] == "turn skipped after 0 of 2 steps"
    # The status says the run is not whole: which partition, which round, how much of the test set.
    final = status(folder)
    assert final["state"] == "finished" and final["complete"] is False
    assert final["failed_partitions"] == {"1": [0]} and final["test_share"] == 0.5


def test_fl_averages_the_others_when_a_client_fails(run_config, fake_grid):
    raw = run_config(paradigm="fl")
    grid = fake_grid(client_app, raw, 2)
    grid.interceptors[2] = lambda message, reply: (_ for _ in ()).throw(RuntimeError("out of memory"))
    folder = run(grid, load_config(raw))
    record = metrics(folder)[0]
    assert record["clients_averaged"] == 1
    assert [f["client"] for f in record["faults"]] == [2] and "out of memory" in record["faults"][0]["reason"]


def test_an_error_reply_the_superlink_makes_is_blamed_on_the_node_it_answers_for(run_config, fake_grid):
    raw = run_config(paradigm="fl")
    grid = fake_grid(client_app, raw, 2, node_ids=[7, 8])

    def expired(message, reply):
        error = Message(Error(code=0, reason="message expired: the node went away"), reply_to=message)
        error.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID  # made by the SuperLink, not the node
        return error

    grid.interceptors[8] = expired
    folder = run(grid, load_config(raw))
    record = metrics(folder)[0]
    assert record["clients_averaged"] == 1
    # One fault, on node 8 (partition 1), with the SuperLink's reason; no timeout that did not happen.
    assert [(f["client"], f["reason"]) for f in record["faults"]] == [(8, "message expired: the node went away")]
    assert status(folder)["failed_partitions"] == {"1": [1]}


def poison(message: Message, reply: Message) -> Message:
    """The client's activation with one NaN: the wire must refuse it before the body runs."""
    if message.metadata.message_type == protocol.SPLIT_BEGIN:
        rows = reply.content.array_records[protocol.TENSORS]["rows"]
        data = bytearray(rows.data)
        data[:4] = torch.tensor([float("nan")]).numpy().tobytes()
        reply.content.array_records[protocol.TENSORS]["rows"] = type(rows)(
            dtype=rows.dtype, shape=rows.shape, stype=rows.stype, data=bytes(data)
        )
    return reply


def test_a_non_finite_activation_is_rejected_not_trained_on(run_config, fake_grid):
    raw = run_config(**{"clients.count": 1})
    grid = fake_grid(client_app, raw, 1)
    grid.interceptors[1] = poison
    with pytest.raises(RuntimeError, match="no client completed a step in round 1.*non-finite"):
        run(grid, load_config(raw))


def test_a_server_whose_segment_diverges_stops_the_run_as_its_own_fault(run_config, fake_grid, monkeypatch):
    raw = run_config(paradigm="sl")
    original = split.run_decoder_layers
    monkeypatch.setattr(split, "run_decoder_layers", lambda *args, **kwargs: original(*args, **kwargs) * float("nan"))
    with pytest.raises(ServerFault, match="the server's own .* non-finite values .* not a client's"):
        run(fake_grid(client_app, raw, 2), load_config(raw))
    folder = load_config(raw).run_folder()
    assert json.loads((folder / "status.json").read_text())["error_type"] == "ServerFault"
    assert not (folder / "metrics.jsonl").exists() or not (folder / "metrics.jsonl").read_text()


@pytest.mark.parametrize("paradigm", ["sl", "fl"])
def test_a_client_that_never_answers_times_out(paradigm, run_config, fake_grid):
    raw = run_config(paradigm=paradigm)
    grid = fake_grid(client_app, raw, 2)
    grid.interceptors[2] = lambda message, reply: None
    folder = run(grid, load_config(raw))
    (fault,) = metrics(folder)[0]["faults"]
    assert fault["client"] == 2 and "no reply" in fault["reason"]
    assert status(folder)["failed_partitions"] == {"1": [1]} and status(folder)["complete"] is False


def test_a_run_where_every_message_meets_a_fresh_process_ends_with_the_same_weights(run_config, fake_grid, monkeypatch):
    """Deployment mode: nothing a client learned may live only in its process's memory."""
    from clients import runtime as client_runtime_module

    raw = run_config(**{"train.rounds": 2, "train.steps_per_round": 2, "eval.every": 2})
    warm = run(fake_grid(client_app, {**raw, "output.name": "warm"}, 2), load_config({**raw, "output.name": "warm"}))
    grid = fake_grid(client_app, {**raw, "output.name": "cold"}, 2)
    forgotten = []

    def forget_everything(message, reply):
        forgotten.append(message.metadata.message_type)
        client_runtime_module._RUNTIMES.clear()  # the next message builds its runtime from disk
        return reply

    grid.interceptors = {1: forget_everything, 2: forget_everything}
    monkeypatch.setattr(client_runtime_module, "ONE_MESSAGE_PER_PROCESS", True)
    cold = run(grid, load_config({**raw, "output.name": "cold"}))
    # 2 rounds × 2 clients × (2·2+1) training messages + 2 clients × (begin + 2 tokens) to evaluate.
    assert len(forgotten) == 2 * 2 * (2 * 2 + 1) + 2 * 3
    assert [r["train_loss"] for r in metrics(cold)] == [r["train_loss"] for r in metrics(warm)]
    assert metrics(cold)[1]["test_accuracy"] == metrics(warm)[1]["test_accuracy"]
    for key, value in torch.load(warm.checkpoint_path(2), weights_only=True)["lora"].items():
        torch.testing.assert_close(torch.load(cold.checkpoint_path(2), weights_only=True)["lora"][key], value, rtol=0, atol=0)
    for partition in ("partition-0", "partition-1"):
        warm_client = PrivateStore(warm.path / "clients" / partition).load()
        cold_client = PrivateStore(cold.path / "clients" / partition).load()
        assert warm_client["progress"]["step"] == cold_client["progress"]["step"] == 4
        for owner in ("head", "tail"):
            for key, value in warm_client[owner]["lora"].items():
                torch.testing.assert_close(cold_client[owner]["lora"][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("paradigm", ["cl", "fl", "sl", "usl"])
def test_a_longer_run_continues_where_the_shorter_one_ended(paradigm, run_config, fake_grid):
    count = 1 if paradigm == "cl" else 2
    raw = run_config(paradigm=paradigm, **{"clients.count": count, "train.rounds": 2, "train.steps_per_round": 2})
    straight = run(fake_grid(client_app, {**raw, "output.name": "straight"}, count),
                   load_config({**raw, "output.name": "straight"}))
    short = {**raw, "train.rounds": 1}
    run(fake_grid(client_app, short, count), load_config(short))
    extended = run(fake_grid(client_app, raw, count), load_config(raw))
    assert status(extended)["resumed_from"] == 1
    assert [r["round"] for r in metrics(extended)] == [1, 2]
    assert [r["train_loss"] for r in metrics(extended)] == [r["train_loss"] for r in metrics(straight)]


def test_an_activation_whose_lengths_do_not_match_its_rows_is_rejected(run_config, fake_grid):
    raw = run_config(**{"clients.count": 1})
    grid = fake_grid(client_app, raw, 1)
    seen = []

    def wrong_lengths(message: Message, reply: Message) -> Message:
        if message.metadata.message_type == protocol.SPLIT_BEGIN:
            lengths = reply.content.array_records[protocol.TENSORS]["lengths"]
            data = bytearray(lengths.data)
            data[0] += 1  # one token more than the rows hold
            reply.content.array_records[protocol.TENSORS]["lengths"] = type(lengths)(
                dtype=lengths.dtype, shape=lengths.shape, stype=lengths.stype, data=bytes(data)
            )
        return reply

    grid.interceptors[1] = wrong_lengths
    from strategies import app as server_app

    server_app.OBSERVER_FACTORIES.append(lambda config, folder: seen.append)
    try:
        with pytest.raises(RuntimeError, match="rows do not match the per-sample lengths"):
            run(grid, load_config(raw))
    finally:
        server_app.OBSERVER_FACTORIES.pop()
    assert seen == []  # a rejected payload is never shown to observers


def test_bf16_on_the_wire_halves_the_bytes_of_fp32(run_config, fake_grid):
    records = {}
    for dtype in ("fp32", "bf16"):
        raw = run_config(**{"wire.dtype": dtype, "output.name": dtype, "train.steps_per_round": 2})
        records[dtype] = metrics(run(fake_grid(client_app, raw, 2), load_config(raw)))[0]
    assert records["bf16"]["train_tokens"] == records["fp32"]["train_tokens"]
    for direction in ("bytes_up", "bytes_down"):
        # Each message also carries ~1 kB of structure and the pruning record, which do not shrink.
        assert records["bf16"][direction] / records["fp32"][direction] == pytest.approx(0.5, abs=0.05)


class KeepFirst:
    """A stand-in pruning policy: the first `count` patches of every image."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, features, samples):
        return Selection([torch.arange(self.count) for _ in samples])


def test_a_visual_token_selector_plugs_in_on_the_client(run_config, fake_grid, monkeypatch):
    from clients import runtime as client_runtime_module

    monkeypatch.setattr(client_runtime_module, "build_selector", lambda config, **context: KeepFirst(3))
    raw = run_config(**{"train.steps_per_round": 2, "output.name": "pruned"})
    pruned = metrics(run(fake_grid(client_app, raw, 2), load_config(raw)))[0]
    monkeypatch.undo()
    raw = run_config(**{"train.steps_per_round": 2, "output.name": "full"})
    full = metrics(run(fake_grid(client_app, raw, 2), load_config(raw)))[0]
    assert pruned["kept_tokens_mean"] == 3 and full["kept_tokens_mean"] == 16  # tiny: 4 × 4 patches
    assert pruned["patches_removed_share"] == 13 / 16 and full["patches_removed_share"] == 0
    # 13 fewer visual tokens per sample cross the cut (2 clients × 2 steps × 4 samples).
    assert full["train_tokens"] - pruned["train_tokens"] == 13 * 2 * 2 * 4


@pytest.mark.parametrize("paradigm", ["usl", "fl"])
def test_clients_take_turns_by_partition_whatever_their_node_ids(paradigm, run_config, assert_same_outcome):
    """Flower numbers nodes at random; node 907 holding partition 0 and node 13 partition 1 must
    give the run that nodes 1 and 2 give (FL: with half the clients sampled per round)."""
    raw = run_config(paradigm=paradigm, **{"train.rounds": 2, "clients.fraction_train": 0.5 if paradigm == "fl" else 1.0})
    plain = run(InProcessGrid(client_app, {**raw, "output.name": "plain"}, 2), load_config({**raw, "output.name": "plain"}))
    renumbered_raw = {**raw, "output.name": "renumbered"}
    renumbered = run(InProcessGrid(client_app, renumbered_raw, 2, node_ids=[907, 13]), load_config(renumbered_raw))
    assert json.loads((renumbered.path / "nodes.json").read_text()) == {"907": 0, "13": 1}
    assert_same_outcome(plain.path, renumbered.path)


def test_fl_samples_partitions_from_the_seed_and_the_round(run_config):
    config = load_config(run_config(paradigm="fl", **{"clients.count": 4, "clients.fraction_train": 0.5}))
    one = WireFedAvg(config, Wire(), {}, {11: 0, 5: 1, 90: 2, 3: 3})
    other = WireFedAvg(config, Wire(), {}, {7: 0, 8: 1, 1: 2, 2: 3})
    for round_ in range(1, 6):
        drawn = [one.partitions[node] for node in one.sampled_nodes(round_)]
        assert len(drawn) == 2 and drawn == sorted(drawn)
        assert drawn == [other.partitions[node] for node in other.sampled_nodes(round_)]
    assert len({tuple(one.sampled_nodes(round_)) for round_ in range(1, 6)}) > 1


def test_a_metrics_line_torn_by_a_kill_is_dropped_and_the_run_resumes(run_config, fake_grid, caplog):
    raw = run_config(**{"train.rounds": 1})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    log = folder.path / "metrics.jsonl"
    log.write_text(log.read_text() + '{"round": 2, "train_lo')  # round 2's line, cut short before it committed
    longer = {**raw, "train.rounds": 2}
    folder = run(fake_grid(client_app, longer, 2), load_config(longer))
    assert [r["round"] for r in metrics(folder)] == [1, 2] and status(folder)["state"] == "finished"
    assert f"{log} line 2 is torn" in caplog.text
