"""A split training step through Flower messages equals the same step on the whole model,
whether the client keeps its front's graph between messages (a warm process) or
recomputes it (a fresh one); a client killed mid-turn resumes without a lost or
repeated round."""

import json

import pytest
import torch
from flwr.app import Message

from clients import runtime as client_runtime_module
from clients import split as split_module
from clients.app import app as client_app
from clients.runtime import build_runtime
from config import load_config
from strategies.app import run
from training import protocol
from training.batches import batch_positions, decoder_inputs
from training.model import load_party_model, make_optimizer
from training.store import PrivateStore
from vlm.lora import lora_parameters, owner_state_dict
from vlm.segments import next_token_loss, run_decoder_layers
from process_death import Killed, kill_in_round

CLIENT_OWNERS = {"usl": ("head", "tail"), "sl": ("client",)}


def reference_steps(config, tmp_path, steps: int):
    """The unsplit model, one process: client 0's first `steps` batches, one AdamW step each."""
    runtime = build_runtime(config, 0, tmp_path / "reference")
    party = load_party_model(config)
    optimizer = make_optimizer(lora_parameters(party.model).values(), config)
    for step in range(steps):
        positions = batch_positions(len(runtime.train), config.train.batch_size, step, config.model.seed)
        batch = [runtime.train[p] for p in positions]
        inputs, _ = decoder_inputs(
            party.model, runtime.features, runtime.selector, batch, [b.answer_ids for b in batch], party.device
        )
        logits = run_decoder_layers(
            party.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, 4, apply_head=True
        )
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(logits, inputs.labels).backward()
        optimizer.step()
    return party


def split_weights(folder, config, paradigm: str, round_: int) -> dict[str, torch.Tensor]:
    weights = dict(torch.load(folder.checkpoint_path(round_), weights_only=True)["lora"])
    client_parts = PrivateStore(config.run_folder() / "clients" / "partition-0").load()
    for owner in CLIENT_OWNERS[paradigm]:
        weights.update(client_parts[owner]["lora"])
    return weights


def assert_equals_the_unsplit_steps(weights, reference):
    expected = {}
    for segment in reference.segments:
        expected.update(owner_state_dict(reference.model, segment))
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6, msg=key)
    # Every owner's adapters took a step (lora_B starts at zero, so it must have moved).
    changed = [k for k in expected if "lora_B" in k and expected[k].abs().sum() > 0]
    assert len(changed) == len([k for k in expected if "lora_B" in k])


@pytest.fixture
def front_passes(monkeypatch):
    """How often the client built a batch's decoder inputs (selector, projector, merge)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return decoder_inputs(*args, **kwargs)

    monkeypatch.setattr(split_module, "decoder_inputs", counted)
    return calls


@pytest.mark.parametrize("paradigm", ["usl", "sl"])
@pytest.mark.parametrize("front", ["kept", "recomputed"])
def test_split_steps_through_messages_equal_the_unsplit_steps(paradigm, front, run_config, fake_grid, tmp_path, front_passes):
    steps = 2
    raw = run_config(paradigm=paradigm, **{"clients.count": 1, "train.steps_per_round": steps})
    config = load_config(raw)
    grid = fake_grid(client_app, raw, 1)
    if front == "recomputed":
        # What a fresh process lacks: the kept front (the private state itself is on disk there).
        def drop_kept_front(message: Message, reply: Message) -> Message:
            for runtime in client_runtime_module._RUNTIMES.values():
                runtime.kept_front = None
            return reply

        grid.interceptors[1] = drop_kept_front
    folder = run(grid, config)
    # Kept: one front pass per step. Recomputed: the forward, the backward and (USL) the tail's inputs.
    per_step = 1 if front == "kept" else {"usl": 3, "sl": 2}[paradigm]
    assert len(front_passes) == per_step * steps
    assert_equals_the_unsplit_steps(split_weights(folder, config, paradigm, 1), reference_steps(config, tmp_path, steps))


def test_a_warm_client_writes_its_private_state_once_per_turn(run_config, fake_grid, monkeypatch):
    saves = []
    original = PrivateStore.save

    def counted(store, round_, parts):
        saves.append((store.directory.name, round_, sorted(parts)))
        return original(store, round_, parts)

    monkeypatch.setattr(PrivateStore, "save", counted)
    raw = run_config(**{"train.rounds": 2, "train.steps_per_round": 3})
    run(fake_grid(client_app, raw, 2), load_config(raw))
    assert saves == [
        (f"partition-{p}", round_, ["head", "progress", "tail"]) for round_ in (1, 2) for p in (0, 1)
    ]


def test_a_warm_client_parses_the_run_config_once(run_config, fake_grid, monkeypatch):
    parses = []
    original = client_runtime_module.load_config
    monkeypatch.setattr(client_runtime_module, "_CONFIGS", {})
    monkeypatch.setattr(client_runtime_module, "load_config", lambda raw: parses.append(1) or original(raw))
    raw = run_config(**{"train.rounds": 2, "train.steps_per_round": 2, "eval.every": 2})
    run(fake_grid(client_app, raw, 2), load_config(raw))
    assert len(parses) == 1  # for 2 clients × 2 rounds × 5 training messages and the evaluation


@pytest.mark.parametrize("paradigm", ["usl", "sl"])
def test_a_client_killed_mid_turn_resumes_without_a_lost_or_repeated_round(paradigm, run_config, fake_grid):
    raw = run_config(paradigm=paradigm, **{"train.rounds": 3, "train.steps_per_round": 3})
    straight_raw = {**raw, "output.name": "straight"}
    straight = run(fake_grid(client_app, straight_raw, 2), load_config(straight_raw))
    backward = {"usl": protocol.USL_HEAD, "sl": protocol.SL_BACKWARD}[paradigm]

    def lose_memory() -> None:
        client_runtime_module._RUNTIMES.clear()
        client_runtime_module._BASES.clear()

    grid = fake_grid(client_app, raw, 2)
    # Client 1 is two steps into its round-2 turn, none of it on disk.
    grid.interceptors[1] = kill_in_round(2, backward, at=2, before=lose_memory)
    with pytest.raises(Killed):
        run(grid, load_config(raw))
    resumed = run(fake_grid(client_app, raw, 2), load_config(raw))

    def records(folder):
        return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]

    assert [r["round"] for r in records(resumed)] == [1, 2, 3]
    assert [r["train_loss"] for r in records(resumed)] == [r["train_loss"] for r in records(straight)]
    want = torch.load(straight.checkpoint_path(3), weights_only=True)["lora"]
    got = torch.load(resumed.checkpoint_path(3), weights_only=True)["lora"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    for partition in ("partition-0", "partition-1"):
        want_client = PrivateStore(straight.path / "clients" / partition).load()
        got_client = PrivateStore(resumed.path / "clients" / partition).load()
        assert got_client["progress"]["step"] == want_client["progress"]["step"] == 9
        for owner in CLIENT_OWNERS[paradigm]:
            for key, value in want_client[owner]["lora"].items():
                torch.testing.assert_close(got_client[owner]["lora"][key], value, rtol=0, atol=0)
