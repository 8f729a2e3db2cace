"""What a USL server receives: the two cuts' traffic, nothing about the inputs or outputs."""

import pytest
from flwr.app import Message

from clients.app import app as client_app
from pruning.metrics import RECORD_PREFIX
from config import load_config
from strategies import app as server_app
from strategies.app import run
from training import protocol


# A hijacking server (FSHA) answers with other gradients, but receives exactly what an honest one does.
@pytest.mark.parametrize("threat", ["none", "active-fsha"])
def test_the_server_receives_only_cut_activations_and_gradients(threat, run_config, fake_grid, monkeypatch):
    raw = run_config(**{"train.steps_per_round": 2, "eval.every": 1, "threat.model": threat,
                        "threat.fsha_pretrain_steps": 20, "threat.fsha_decoder_width": 16, "threat.aux_limit": 32})
    grid = fake_grid(client_app, raw, 2)
    replies: list[Message] = []
    for node in (1, 2):
        grid.interceptors[node] = lambda message, reply: replies.append(reply) or reply
    observed = []
    monkeypatch.setattr(server_app, "OBSERVER_FACTORIES", [lambda config, folder: observed.append])
    run(grid, load_config(raw))

    # Training: 2 clients × (2·2 + 1) replies; evaluation: 2 clients × (begin + 1 or 2 tokens).
    assert 2 * 5 + 2 * 2 <= len(replies) <= 2 * 5 + 2 * 3
    for reply in replies:
        content = reply.content
        assert set(content.config_records) == set()  # no text, no ids
        assert set(content.array_records) == {"wire"}
        assert set(content.array_records["wire"]) <= {"rows", "lengths", "grad"}
        # The loss, evaluation counts and scores (per question: its position in the test split) and
        # the pruning record (kept counts, exclusion ratios, mark-removal counts) — no labels, no logits.
        names = set(content.metric_records["metrics"])
        assert {n for n in names if not n.startswith(RECORD_PREFIX)} <= {
            "loss", "eval-batches", "correct", "count", protocol.QUESTIONS, protocol.QUESTION_SCORES}
    kinds = {transfer.kind for transfer in observed}
    assert kinds == {"activation at CA", "gradient at CB", "end of turn", "evaluation activation at CA", "evaluation score"}
    hidden = 32  # tiny profile
    for transfer in observed:
        for tensor in transfer.tensors.values():
            assert tensor.ndim == 1 or tensor.shape[-1] == hidden  # per-token states or per-sample lengths
