"""SARA puts shuffled, pruned visual rows back in place — unless the rows carry no position."""

import copy
import dataclasses

import pytest
import torch

from attacks import build_attack
from attacks.adaptive import AttackerEdge
from attacks.knowledge import visual_rows
from attacks.sara import position_metrics
from privacy import DefenseChain
from privacy.drop import DropOptions
from privacy.edge import edge_vision_tokens, select_sent
from privacy.shuffle import ShuffleOptions
from vlm.segments import llava_parts

# The paper's structure at the tiny width, with the rates raised (1e-3) and the epochs set so that
# a few hundred steps on 300 auxiliary images get there. Chained: on pruned rows, which the front
# recomputes without the dropped tokens, an MAE and decoder trained on full grids (the paper's
# way, which the smoke sweep runs) come out no better than spreading the rows in arrival order.
FAST = {"stage_inputs": "chained", "tpp_epochs": 40, "tpp_lr": 1e-3, "tpp_width": 64, "mae_epochs": 16, "mae_lr": 1e-3, "mae_layers": 2,
        "decoder_epochs": 21, "decoder_width": 64, "keep_ratios": (0.5, 1.0), "progress": False}


def shuffled_keep_sets(count, num_patches, seed=5):
    """What a pruning-and-shuffling client sends: a random half or more of the patches, in random order."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(num_patches // 2, num_patches + 1, (count,), generator=generator)
    return [torch.randperm(num_patches, generator=generator)[: int(size)] for size in sizes]


def test_sara_restores_shuffled_token_order_far_above_chance(knowledge, victims, aux, record_activations):
    keep = shuffled_keep_sets(32, knowledge.num_patches)
    recording, truth = record_activations(victims[:32], keep=keep, pruning="fixed")
    result = build_attack("sara", knowledge, **FAST).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["position_accuracy"] > 6 * result.metrics["chance_position_accuracy"]
    assert result.metrics["spread_position_accuracy"] < 2 * result.metrics["chance_position_accuracy"]
    # Putting rows in place is what makes the image come back: the same pipeline without it does worse.
    assert result.metrics["psnr"] > result.metrics["without_positions_psnr"] + 0.5


def test_sara_cannot_place_rows_that_carry_no_position(knowledge, victims, aux):
    """SPEC.md §3's defense: without the vision tower's positional embeddings (on the victim's and, to
    be fair, on the attacker's model) nothing in a row says where its patch was."""
    positionless = copy.deepcopy(knowledge.model)
    with torch.no_grad():
        llava_parts(positionless).vision_tower.embeddings.position_embedding.weight.zero_()
    defended = dataclasses.replace(knowledge, model=positionless)
    keep = shuffled_keep_sets(32, knowledge.num_patches)
    features = defended.features(defended.pixel_values(victims[:32]))
    with torch.no_grad():
        rows = visual_rows(positionless, features, defended.prefix_ids, defended.first_cut, keep)
    attack = build_attack("sara", defended, **{**FAST, "mae_epochs": 0, "decoder_epochs": 0}).fit(aux)
    metrics = position_metrics(attack.predict_positions(rows), keep, knowledge.num_patches)
    print(metrics)
    assert metrics["position_accuracy"] < 2 * metrics["chance_position_accuracy"]


@pytest.mark.parametrize("fills", ["all", "empty"])
def test_the_mae_restores_the_slots_its_option_names(knowledge, aux, fills):
    """mae_fills="empty" keeps every placed row as it arrived and takes the MAE's rows only where
    nothing was placed; "all" (the paper) takes the MAE's rows everywhere."""
    untrained = {"tpp_epochs": 0, "mae_epochs": 0, "decoder_epochs": 0}
    attack = build_attack("sara", knowledge, **{**FAST, **untrained, "mae_fills": fills}).fit(aux[:4])
    grid = torch.randn(2, knowledge.num_patches, knowledge.hidden_size)
    empty = torch.zeros(knowledge.num_patches, dtype=torch.bool)
    empty[::3] = True
    grid[:, empty] = 0
    with torch.no_grad():
        restored, mae = attack.restore_grid(grid), attack.mae(grid)
    assert torch.equal(restored[:, empty], mae[:, empty])
    assert torch.equal(restored[:, ~empty], grid[:, ~empty] if fills == "empty" else mae[:, ~empty])


def test_bad_options_are_refused_before_any_training(knowledge):
    with pytest.raises(ValueError, match="stage_inputs='stacked'; allowed: paper, chained"):
        build_attack("sara", knowledge, stage_inputs="stacked")
    with pytest.raises(ValueError, match=r"keep_ratios=\(0.8, 0.2\) must satisfy"):
        build_attack("sara", knowledge, keep_ratios=(0.8, 0.2))
    with pytest.raises(ValueError, match=r"mae_mask_ratios=\(0.2, 1.0\) must satisfy"):
        build_attack("sara", knowledge, mae_mask_ratios=(0.2, 1.0))
    with pytest.raises(ValueError, match="mae_fills='some'; allowed: all, empty"):
        build_attack("sara", knowledge, mae_fills="some")
    with pytest.raises(ValueError, match="tpp_width=0 must be at least 1"):
        build_attack("sara", knowledge, tpp_width=0)


def test_the_attackers_edge_sends_what_a_client_s_edge_would(knowledge, victims):
    """Adaptive SARA's simulated sends: with the client's seed the attacker's copy of the edge gives
    the very rows and order a client's edge sends (privacy.edge), and only positions the keep set holds."""
    chain = DefenseChain.build(["drop", "shuffle"], {"drop": DropOptions(r=4), "shuffle": ShuffleOptions()}, seed=7)
    pixels = knowledge.pixel_values(victims[:6])
    keep = shuffled_keep_sets(6, knowledge.num_patches)
    grid, sent = AttackerEdge(knowledge, chain, seed=7).sends(pixels, keep)
    client = edge_vision_tokens(knowledge.model, pixels, chain, chain.seed_for(0, 0, 1))
    rows, positions = select_sent(client, keep, knowledge.num_patches)
    for b in range(6):
        assert torch.equal(sent[b], positions[b]) and set(sent[b].tolist()) <= set(keep[b].tolist())
        torch.testing.assert_close(grid[b, sent[b]], rows[b], rtol=0, atol=0)
    # The edge dropped some kept patches' tokens.
    assert sum(s.numel() for s in sent) < sum(k.numel() for k in keep)


def test_adaptive_sara_needs_the_run_s_defenses_before_it_fits(knowledge, aux):
    with pytest.raises(ValueError, match="adaptive=True simulates the run's defenses"):
        build_attack("sara", knowledge, adaptive=True, progress=False).fit(aux[:4])
