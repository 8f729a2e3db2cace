"""Virtual clients served by one process share one frozen base; each party holds only what it runs."""

import json

import pytest
import torch

from clients import runtime as client_runtime_module
from clients.app import app as client_app
from config import load_config
from strategies.app import run
from training.model import CLIENT, SERVER, load_party_model, party_parameter_bytes
from vlm.loading import count_parameters, storage_bytes
from vlm.lora import lora_parameters
from vlm.profiles import get_profile
from vlm.segments import run_decoder_layers


@pytest.mark.parametrize("paradigm", ["usl", "fl"])
def test_four_virtual_clients_hold_one_base_and_their_own_adapters_and_adamw(paradigm, run_config, fake_grid, monkeypatch):
    """USL's clients each keep their adapters and AdamW; FL's keep nothing between messages, so
    they share one adapter set."""
    monkeypatch.setattr(client_runtime_module, "_BASES", {})
    monkeypatch.setattr(client_runtime_module, "_RUNTIMES", {})
    raw = run_config(paradigm=paradigm, **{"clients.count": 4, "data.train_limit": 32, "data.test_limit": 8})
    run(fake_grid(client_app, raw, 4), load_config(raw))
    runtimes = list(client_runtime_module._RUNTIMES.values())
    assert len(runtimes) == 4 and len({id(rt.model) for rt in runtimes}) == 1
    assert len({rt.adapter for rt in runtimes}) == (1 if paradigm == "fl" else 4)
    model = runtimes[0].model
    base = [p for name, p in model.named_parameters() if "lora_" not in name]
    own = []  # each client's adapters and the AdamW state that trains them
    for rt in runtimes[:1] if paradigm == "fl" else runtimes:
        for owner in rt.owned:
            own += rt.parameters(owner)
        if paradigm != "fl":  # FL's AdamW is per round and not kept
            assert rt.optimizers
            own += [v for state in (o.state.values() for o in rt.optimizers.values()) for s in state for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0]
    held = storage_bytes([*model.parameters(), *own])
    # Besides: the base's "default" set, the seeded start every client begins from.
    budget = storage_bytes(base) + storage_bytes(own) + storage_bytes(list(lora_parameters(model).values()))
    assert held <= 1.01 * budget
    # Four bases would be far over it.
    assert 4 * storage_bytes(base) > 1.1 * budget


def test_a_process_serving_runs_one_after_another_keeps_only_the_current_runs_adapters(run_config, fake_grid, monkeypatch):
    monkeypatch.setattr(client_runtime_module, "_BASES", {})
    monkeypatch.setattr(client_runtime_module, "_RUNTIMES", {})
    first, second = run_config(**{"output.name": "first"}), run_config(**{"output.name": "second"})
    run(fake_grid(client_app, first, 2), load_config(first))
    model = next(iter(client_runtime_module._RUNTIMES.values())).model
    run(fake_grid(client_app, second, 2), load_config(second))
    runtimes = list(client_runtime_module._RUNTIMES.values())
    assert {rt.config.output.name for rt in runtimes} == {"second"}
    assert set(model.peft_config) == {"default", *(rt.adapter for rt in runtimes)}
    # The first run, extended, picks up from its disk exactly as if it had never been released.
    longer = run_config(**{"output.name": "first", "train.rounds": 2})
    resumed = run(fake_grid(client_app, longer, 2), load_config(longer))
    monkeypatch.setattr(client_runtime_module, "_RUNTIMES", {})
    straight_config = run_config(**{"output.name": "straight", "train.rounds": 2})
    straight = run(fake_grid(client_app, straight_config, 2), load_config(straight_config))
    losses = [[record["train_loss"] for record in map(json.loads, (f.path / "metrics.jsonl").read_text().splitlines())]
              for f in (resumed, straight)]
    assert losses[0] == losses[1]


@pytest.mark.parametrize(("paradigm", "role"), [("usl", CLIENT), ("usl", SERVER), ("sl", CLIENT), ("sl", SERVER), ("fl", CLIENT)])
def test_a_party_materialises_only_the_modules_it_runs(paradigm, role, run_config):
    config = load_config(run_config(paradigm=paradigm))
    party = load_party_model(config, role)
    held = sum(p.numel() * p.element_size() for n, p in party.model.named_parameters()
               if "lora_" not in n and p.device.type != "meta")
    profile = get_profile("tiny")
    full = load_party_model(config)
    expected = party_parameter_bytes(profile, count_parameters(full.model))[f"{paradigm} {role}"]
    element = next(full.model.parameters()).element_size()
    assert held == expected["fp32"] * element // 4
    assert all(p.device.type != "meta" for p in full.model.parameters())
    assert held < sum(p.numel() * p.element_size() for n, p in full.model.named_parameters() if "lora_" not in n) or paradigm == "fl"


def test_the_usl_servers_body_computes_as_the_whole_models(run_config):
    config = load_config(run_config(paradigm="usl"))
    server, full = load_party_model(config, SERVER), load_party_model(config)
    body = next(segment for segment in server.segments if segment.owner == "body")
    hidden = torch.randn(2, 5, get_profile("tiny").hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=torch.long)
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        got = run_decoder_layers(server.model, hidden, mask, positions, body.start, body.stop)
        want = run_decoder_layers(full.model, hidden, mask, positions, body.start, body.stop)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert {p.device.type for p in lora_parameters(server.model).values()} == {"cpu", "meta"}


def test_party_bytes_at_7b_add_up():
    from vlm.loading import build_model_on_meta

    profile = get_profile("llava-1.5-7b")
    counts = count_parameters(build_model_on_meta(profile))
    held = party_parameter_bytes(profile, counts)
    assert held["fl client"]["fp32"] == 4 * counts.total
    for paradigm in ("usl", "sl"):
        assert held[f"{paradigm} client"]["16-bit"] + held[f"{paradigm} server"]["16-bit"] == 2 * counts.total
    assert held["usl server"]["16-bit"] < held["usl client"]["16-bit"] < held["fl client"]["16-bit"]
