"""DP-FedAvg in whole FL runs: Flower's wrappers and mods as privacy.dp configures them, the noise
at its calibrated scale, clipping that bounds each client's update, and a budget that survives a resume."""

import json

import pytest
import torch
from flwr.app import Message

from clients.app import app as client_app
from config import load_config
from strategies.app import run
from training import protocol
from training.model import load_party_model
from vlm.lora import owner_state_dict
from wire import Wire
from process_death import Killed, kill_in_round


def metrics(folder):
    return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]


def final_adapters(folder):
    return folder.load_checkpoint()["arrays"]


def adapters(record):
    shapes = {key: tuple(array.shape) for key, array in record.items()}
    return Wire("fp32").decode(record, protocol.ADAPTER_UPDATE.expectation(adapter_shapes=shapes), what="adapters")


def fl_dp_config(run_config, name, **overrides):
    return run_config(paradigm="fl", **{"train.steps_per_round": 2, "output.name": name, **overrides})


@pytest.mark.parametrize(("mode", "spread"), [("central", lambda z, clip, m: z * clip / m),
                                             ("local", lambda z, clip, m: z * clip / m**0.5)])
def test_the_noise_added_has_the_calibrated_scale(mode, spread, run_config, fake_grid):
    """One round twice, alike but for the noise multiplier: the global adapters differ by the
    noise, whose std is z·clip over the 2 clients' average (central: noise on the sum; local:
    each client's own noise, averaged)."""
    clip, z = 0.05, 3.0
    finals = {}
    for name, multiplier in (("quiet", 1e-9), ("noisy", z)):
        raw = fl_dp_config(run_config, name, **{"privacy.dp.mode": mode, "privacy.dp.clip": clip,
                                                "privacy.dp.noise_multiplier": multiplier})
        finals[name] = final_adapters(run(fake_grid(client_app, raw, 2), load_config(raw)))
    noise = torch.cat([(finals["noisy"][key] - finals["quiet"][key]).flatten() for key in finals["quiet"]])
    assert noise.numel() > 2000
    assert noise.std().item() == pytest.approx(spread(z, clip, 2), rel=0.1)
    assert noise.mean().abs().item() < 0.1 * spread(z, clip, 2)


def test_client_side_clipping_bounds_every_client_s_update(run_config, fake_grid):
    clip = 1e-3
    norms = []

    def update_norm(message: Message, reply: Message) -> Message:
        if message.metadata.message_type == protocol.TRAIN:
            sent, back = adapters(message.content.array_records[protocol.ARRAYS]), adapters(reply.content.array_records[protocol.ARRAYS])
            norms.append(torch.sqrt(sum(((back[k] - sent[k]) ** 2).sum() for k in sent)).item())
        return reply

    for mode in ("off", "central-client-clipping"):
        raw = fl_dp_config(run_config, mode, **{"privacy.dp.mode": mode, "privacy.dp.clip": clip,
                                                "privacy.dp.noise_multiplier": 0.0 if mode == "off" else 1e-9})
        grid = fake_grid(client_app, raw, 2)
        grid.interceptors = {1: update_norm, 2: update_norm}
        run(grid, load_config(raw))
    unclipped, clipped = norms[:2], norms[2:]
    assert min(unclipped) > 10 * clip  # the bound binds
    assert len(clipped) == 2 and all(0 < norm <= clip * 1.001 for norm in clipped)


def test_server_side_clipping_bounds_the_round_s_update(run_config, fake_grid):
    """Flower's server-side wrapper around the FL strategy (the wire outside both) clips the
    decoded bf16 updates: the global update keeps within the clipping norm."""
    clip = 1e-3
    raw = fl_dp_config(run_config, "clipped", **{"train.rounds": 1, "wire.dtype": "bf16", "privacy.dp.mode": "central",
                                                 "privacy.dp.clip": clip, "privacy.dp.noise_multiplier": 1e-9})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    party = load_party_model(load_config(raw))
    initial = owner_state_dict(party.model, party.segments[0])
    final = final_adapters(folder)
    update = torch.sqrt(sum(((final[k].float() - initial[k].float()) ** 2).sum() for k in final)).item()
    assert 0 < update <= clip * 1.001


@pytest.mark.parametrize("mode", ["central", "central-adaptive"])
def test_a_resumed_dp_run_spends_the_same_budget_and_adds_the_same_noise(mode, run_config, fake_grid):
    dp = {"privacy.dp.mode": mode, "privacy.dp.clip": 0.01, "privacy.dp.noise_multiplier": 0.5 if mode == "central" else 0.15,
          "train.rounds": 3}
    if mode == "central-adaptive":
        dp["privacy.dp.clipped_count_stddev"] = 0.5
    straight_raw = fl_dp_config(run_config, "straight", **dp)
    straight = run(fake_grid(client_app, straight_raw, 2), load_config(straight_raw))

    raw = fl_dp_config(run_config, "run", **dp)
    grid = fake_grid(client_app, raw, 2)
    grid.interceptors[1] = kill_in_round(3)
    with pytest.raises(Killed):
        run(grid, load_config(raw))
    resumed = run(fake_grid(client_app, raw, 2), load_config(raw))

    spent = [(r["dp_epsilon"], r["dp_releases"], r.get("dp_clip")) for r in metrics(resumed)]
    assert spent == [(r["dp_epsilon"], r["dp_releases"], r.get("dp_clip")) for r in metrics(straight)]
    assert [release for _, release, _ in spent] == [1, 2, 3] and spent[0][0] < spent[1][0] < spent[2][0]
    if mode == "central-adaptive":
        assert len({clip for _, _, clip in spent}) == 3  # the norm moved every round and resumed where it was
    status = json.loads((resumed.path / "status.json").read_text())
    assert status["privacy_spent"]["dp_epsilon"] == spent[-1][0] and status["dp"]["mode"] == mode
    got, want = final_adapters(resumed), final_adapters(straight)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
