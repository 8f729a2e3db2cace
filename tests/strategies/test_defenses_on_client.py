"""Defenses act on the client, before the wire: the server, the recorder and the attacks see only
the defended payload, and a front recomputed in a fresh process sends the same one."""

import json

import pytest
import torch
from flwr.app import Message

from attacks.recording import Recording
from clients import runtime as client_runtime_module
from clients.app import app as client_app
from config import load_config
from strategies import app as server_app
from strategies.app import run
from training import protocol

# Every registered defense at once, in each split paradigm (GRADIENT defenses only where a
# client returns a gradient), composed with pruning; the random EDGE ones (drop, shuffle) must
# draw again what they drew, or a recomputed front would send other rows.
ALL = {
    "usl": "tome,drop,shuffle,nopeek,noise,sparsify,pripert,grad_noise,grad_topk",
    "sl": "tome,drop,shuffle,nopeek,noise,sparsify,pripert",
}
DEFENSE_OPTIONS = {"privacy.tome.r": 2, "privacy.drop.r": 2, "privacy.noise.variance": 1e-4, "privacy.pripert.iterations": 2, "privacy.sparsify.ratio": 0.3,
                   "privacy.pripert.sparsity": 0.3, "privacy.grad_topk.ratio": 0.5,
                   "pruning.policy": "fixed", "pruning.ratio": 0.5}


def observed_run(raw: dict, grid, monkeypatch) -> tuple[list, dict]:
    observed = []
    monkeypatch.setattr(server_app, "OBSERVER_FACTORIES", [lambda config, folder: observed.append])
    folder = run(grid, load_config(raw))
    weights = dict(torch.load(folder.checkpoint_path(1), weights_only=True)["lora"])
    return observed, weights


@pytest.mark.parametrize("paradigm", ["usl", "sl"])
def test_a_recomputed_front_sends_the_same_defended_payload_and_takes_the_same_step(
    paradigm, run_config, fake_grid, monkeypatch
):
    raw = run_config(paradigm=paradigm, **{"clients.count": 1, "train.steps_per_round": 2,
                                           "privacy.defenses": ALL[paradigm], **DEFENSE_OPTIONS})
    kept = observed_run(raw, fake_grid(client_app, raw, 1), monkeypatch)

    fresh_raw = {**raw, "output.name": "recomputed"}
    grid = fake_grid(client_app, fresh_raw, 1)

    def drop_kept_front(message: Message, reply: Message) -> Message:
        for runtime in client_runtime_module._RUNTIMES.values():
            runtime.kept_front = None
        return reply

    grid.interceptors[1] = drop_kept_front
    recomputed = observed_run(fresh_raw, grid, monkeypatch)

    sent = [(t.kind, t.tensors) for t in kept[0] if t.tensors]
    assert {kind for kind, _ in sent} >= {protocol.FIRST_CUT_ACTIVATION[paradigm].name}
    assert len(sent) == len([t for t in recomputed[0] if t.tensors])
    for (kind, tensors), transfer in zip(sent, [t for t in recomputed[0] if t.tensors], strict=True):
        assert transfer.kind == kind
        for name, tensor in tensors.items():
            torch.testing.assert_close(transfer.tensors[name], tensor, rtol=0, atol=0, msg=f"{kind}: {name}")
    assert kept[1].keys() == recomputed[1].keys()
    for key, value in kept[1].items():
        torch.testing.assert_close(recomputed[1][key], value, rtol=0, atol=1e-6, msg=key)


def test_the_recording_holds_the_defended_payload_and_names_the_defenses(run_config, fake_grid):
    raw = run_config(**{"train.steps_per_round": 2, "eval.every": 1, "threat.model": "passive",
                        "privacy.defenses": "sparsify,grad_topk", "privacy.sparsify.ratio": 0.5,
                        "privacy.grad_topk.ratio": 0.75})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    recording = Recording.open(folder.path)
    described = [{"name": "sparsify", "stage": "activation", "options": {"ratio": 0.5, "level": "element"}},
                 {"name": "grad_topk", "stage": "gradient", "options": {"ratio": 0.75}}]
    assert recording.header["defenses"] == described
    assert json.loads((folder.path / "status.json").read_text())["defenses"] == described
    shares = {"activation at CA": 0.5, "evaluation activation at CA": 0.5, "gradient at CB": 0.75}
    seen = set()
    for entry in recording.entries:
        if entry.kind not in shares:
            continue
        tensors = recording.tensors(entry)
        payload = tensors[protocol.GRAD] if protocol.GRAD in tensors else tensors[protocol.ROWS]
        lengths = (tensors[protocol.LENGTHS] if protocol.LENGTHS in tensors
                   else recording.tensors(_activation_before(recording, entry))[protocol.LENGTHS])
        for sample in torch.split(payload, lengths.tolist()):
            assert int((sample == 0).sum()) == round(shares[entry.kind] * sample.numel())
        seen.add(entry.kind)
    assert seen == set(shares)


def _activation_before(recording, entry):
    """The activation at CA of the step whose gradient at CB `entry` is (same round, client)."""
    earlier = [e for e in recording.entries if e.kind == "activation at CA" and e.round == entry.round
               and e.client == entry.client and e.seq < entry.seq]
    return earlier[-1]
