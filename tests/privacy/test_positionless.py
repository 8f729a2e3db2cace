"""The positionless edge (privacy.positionless): no positional embedding, a distillation step that
brings the model's answers back, and the artefact a run selects (qpriv-privacy positionless)."""

import json

import pytest
import torch

from config import ConfigError, load_config
from privacy import DefenseChain, DefenseSeed
from privacy.edge import edge_vision_tokens
from privacy.positionless import (
    DistillBatch, DistillSettings, PositionlessEdge, PositionlessOptions, distill_block, held_out_kl, positionless_tower,
)
from sims import privacy_cli
from sims.privacy_cli import load_front
from vlm.segments import llava_parts, vision_hidden_states


@pytest.fixture(scope="module")
def teacher():
    """The tiny model with its answers made decisive and its positions made to matter (random tiny
    weights give near-uniform logits, which no edge could move), and 48 training rows."""
    front = load_front("tiny", "random", 48)
    k, parts = front.knowledge, llava_parts(front.knowledge.model)
    with torch.no_grad():
        parts.lm_head.weight.mul_(30)
        parts.vision_tower.embeddings.position_embedding.weight.mul_(30)
    rows = DistillBatch(k.pixel_values(front.rows), [k.prompt_ids(s.question) for s in front.rows],
                        [k.answer_ids(s.answer) for s in front.rows])
    return k.model, rows.take(torch.arange(32)), rows.take(torch.arange(32, 48))


def test_the_positionless_tower_has_no_positional_embedding_and_leaves_the_model_s_alone(teacher):
    model, _, _ = teacher
    original = llava_parts(model).vision_tower
    tower = positionless_tower(original)
    assert not tower.embeddings.position_embedding.weight.any()
    assert original.embeddings.position_embedding.weight.abs().sum() > 0


def test_distilling_a_block_lowers_the_held_out_kl_to_the_original_model(teacher):
    model, train, held_out = teacher
    tower = positionless_tower(llava_parts(model).vision_tower).requires_grad_(False)
    before = held_out_kl(model, tower, held_out, 4.0)
    frozen = {name: p.clone() for name, p in tower.named_parameters() if not name.startswith("encoder.layers.0.")}
    distill_block(model, tower, 1, train, DistillSettings(steps=40, lr=1e-3))
    after = held_out_kl(model, tower, held_out, 4.0)
    print(before, after)
    assert after < 0.5 * before
    # Only block 1 trained.
    assert all(torch.equal(p, frozen[name]) for name, p in tower.named_parameters() if name in frozen)


def test_the_adversarial_variant_trains_a_position_predictor_against_the_edge(teacher):
    model, train, _ = teacher
    tower = positionless_tower(llava_parts(model).vision_tower).requires_grad_(False)
    metrics = distill_block(model, tower, 1, train, DistillSettings(steps=5, lr=1e-3, position_weight=0.5))
    assert {"kd", "position_loss", "position_accuracy"} <= set(metrics)


def test_the_prepare_command_writes_the_artefact_resumes_and_a_run_selects_it(tmp_path, monkeypatch):
    out = tmp_path / "edge"
    argv = ["positionless", "--profile", "tiny", "--stage", "random", "--steps", "3", "--rows", "8", "--held-out",
            "4", "--out", str(out), "--no-progress"]
    assert privacy_cli.main(argv) == 0
    report = json.loads((out / "positionless.json").read_text())
    assert [b["block"] for b in report["blocks"]] == [1]
    # A rerun of the same settings reuses the cached block instead of training it again.
    monkeypatch.setattr("privacy.positionless.distill_block", lambda *a, **k: pytest.fail("retrained a cached block"))
    assert privacy_cli.main(argv) == 0
    config = load_config({"output.name": "x", "model.profile": "tiny", "model.stage": "random", "paradigm": "sl",
                          "privacy.defenses": "positionless", "privacy.positionless.artifact": str(out)})
    edge = PositionlessEdge(config.privacy.positionless)
    from training.model import load_party_model

    model = load_party_model(config).model
    pixels = torch.randn(2, 3, 32, 32)
    sent = edge_vision_tokens(model, pixels, DefenseChain([edge]), DefenseSeed(0, 0, 1, 0))
    tower = edge.vision_tower(llava_parts(model).vision_tower)
    assert not tower.embeddings.position_embedding.weight.any()
    with torch.no_grad():
        torch.testing.assert_close(torch.stack(sent.tokens), vision_hidden_states(model, pixels, tower)[-1],
                                   rtol=0, atol=1e-6)


def test_a_run_without_the_artefact_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"privacy\.positionless\.artifact"):
        load_config({"output.name": "x", "model.profile": "tiny", "privacy.defenses": "positionless"})
    with pytest.raises(ConfigError, match=r"privacy\.positionless\.artifact"):
        load_config({"output.name": "x", "model.profile": "tiny", "privacy.defenses": "positionless",
                     "privacy.positionless.artifact": str(tmp_path)})
    assert PositionlessOptions().artifact == ""
