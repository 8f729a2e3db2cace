"""A split training step through Flower messages equals the same step on the whole model."""

import pytest
import torch

from clients.app import app as client_app
from clients.runtime import build_runtime
from config import load_config
from strategies.app import run
from training.batches import batch_positions, decoder_inputs
from training.model import load_party_model, make_optimizer
from training.store import PrivateStore
from vlm.lora import lora_parameters, owner_state_dict
from vlm.segments import next_token_loss, run_decoder_layers


def reference_step(config, tmp_path):
    """The unsplit model, one process: client 0's first batch, one AdamW step on every adapter."""
    runtime = build_runtime(config, 0, tmp_path / "reference")
    party = load_party_model(config)
    batch = [runtime.train[p] for p in batch_positions(len(runtime.train), config.train.batch_size, 0, config.model.seed)]
    inputs, _ = decoder_inputs(party.model, runtime.features, runtime.selector, batch, [b.answer_ids for b in batch], party.device)
    logits = run_decoder_layers(
        party.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, 4, apply_head=True
    )
    optimizer = make_optimizer(lora_parameters(party.model).values(), config)
    next_token_loss(logits, inputs.labels).backward()
    optimizer.step()
    return party


@pytest.mark.parametrize("paradigm", ["usl", "sl"])
def test_one_step_through_messages_equals_the_unsplit_step(paradigm, run_config, fake_grid, tmp_path):
    config = load_config(run_config(paradigm=paradigm, **{"clients.count": 1}))
    grid = fake_grid(client_app, run_config(paradigm=paradigm, **{"clients.count": 1}), 1)
    folder = run(grid, config)
    reference = reference_step(config, tmp_path)

    server_state = torch.load(folder.checkpoint_path(1), weights_only=True)["lora"]
    client_parts = PrivateStore(config.run_folder() / "clients" / "partition-0").load()
    split = dict(server_state)
    for owner in {"usl": ("head", "tail"), "sl": ("client",)}[paradigm]:
        split.update(client_parts[owner]["lora"])
    expected = {}
    for segment in reference.segments:
        expected.update(owner_state_dict(reference.model, segment))
    assert split.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(split[key], value, rtol=0, atol=1e-6, msg=key)
    # Every owner's adapters took a step (lora_B starts at zero, so it must have moved).
    changed = [k for k in expected if "lora_B" in k and expected[k].abs().sum() > 0]
    assert len(changed) == len([k for k in expected if "lora_B" in k])
