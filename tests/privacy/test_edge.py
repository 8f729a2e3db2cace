"""The vision edge (privacy.edge) and its token operations: each changes exactly what it says,
and with none the edge is the vision tower LLaVA reads."""

import pytest
import torch

from config import ConfigError, load_config
from privacy import DefenseChain, DefenseSeed, defense_class, options_from
from privacy.edge import EdgeTokens, _proportional_block, edge_vision_tokens, select_sent
from privacy.tome import bipartite_merge
from training.model import load_party_model
from vlm.segments import llava_parts, vision_features

SEED = DefenseSeed(seed=0, client=1, round=2, step=3)


@pytest.fixture(scope="module")
def tiny():
    """The tiny model (16 patches, 1 vision block before its feature layer) and 4 random images."""
    config = load_config({"output.name": "x", "model.profile": "tiny", "model.stage": "random"})
    model = load_party_model(config).model
    size = llava_parts(model).config.vision_config.image_size
    return model, torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(0))


def chain(**options) -> DefenseChain:
    return DefenseChain.build(list(options), {n: options_from(defense_class(n), o) for n, o in options.items()})


def test_with_no_operation_the_edge_is_the_tower_llava_reads(tiny):
    model, pixels = tiny
    out = edge_vision_tokens(model, pixels, chain(), SEED)
    with torch.no_grad():
        torch.testing.assert_close(torch.stack(out.tokens), vision_features(model, pixels), rtol=0, atol=1e-6)
    assert all(torch.equal(p, torch.arange(16)) for p in out.positions)
    assert all(torch.equal(s, torch.ones(16)) for s in out.sizes)


def test_shuffling_permutes_each_image_s_tokens_from_its_seed_alone(tiny):
    model, pixels = tiny
    plain = torch.stack(edge_vision_tokens(model, pixels, chain(), SEED).tokens)
    out = edge_vision_tokens(model, pixels, chain(shuffle={}), SEED)
    for i, (tokens, where) in enumerate(zip(out.tokens, out.positions, strict=True)):
        assert torch.equal(where.sort().values, torch.arange(16)) and not torch.equal(where, torch.arange(16))
        torch.testing.assert_close(tokens, plain[i, where], rtol=0, atol=1e-6)
    again = edge_vision_tokens(model, pixels, chain(shuffle={}), SEED)
    other = edge_vision_tokens(model, pixels, chain(shuffle={}), DefenseSeed(0, 1, 2, 4))
    assert all(torch.equal(a, b) for a, b in zip(out.positions, again.positions, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(out.positions, other.positions, strict=True))


def test_dropping_keeps_n_minus_r_tokens_per_block_in_patch_order(tiny):
    model, pixels = tiny
    plain = torch.stack(edge_vision_tokens(model, pixels, chain(), SEED).tokens)
    out = edge_vision_tokens(model, pixels, chain(drop={"r": 5}), SEED)
    for where, sizes in zip(out.positions, out.sizes, strict=True):
        assert where.numel() == 16 - 5 and torch.equal(where, where.sort().values) and torch.equal(sizes, torch.ones(11))
    # The tiny tower drops after its only block's attention: the kept tokens are the undropped ones.
    for i, where in enumerate(out.positions):
        torch.testing.assert_close(out.tokens[i], plain[i, where], rtol=0, atol=1e-6)
    other = edge_vision_tokens(model, pixels, chain(drop={"r": 5}), DefenseSeed(0, 1, 2, 4))
    assert not all(torch.equal(a, b) for a, b in zip(out.positions, other.positions, strict=True))


def test_tome_merges_r_tokens_into_size_weighted_means():
    generator = torch.Generator().manual_seed(0)
    n, r = 10, 3
    tokens = torch.randn(2, n, 4, generator=generator)
    sizes = torch.randint(1, 4, (2, n), generator=generator).float()
    state = EdgeTokens(tokens, torch.arange(n).expand(2, n), sizes, torch.randn(2, n, 8, generator=generator), 1, 1)
    merged = bipartite_merge(state, r)
    assert merged.tokens.shape == (2, n - r, 4)
    torch.testing.assert_close(merged.sizes.sum(1), sizes.sum(1))
    # Each B token absorbs the A tokens that chose it: its size and mean are theirs and its own.
    members = bipartite_merge(replace_tokens(state, torch.eye(n).expand(2, n, n)), r).tokens  # share of each input
    for b in range(2):
        for j in range(n - r):
            chosen = members[b, j] > 0
            weights = sizes[b, chosen]
            assert merged.sizes[b, j] == weights.sum()
            torch.testing.assert_close(merged.tokens[b, j], (tokens[b, chosen] * weights[:, None]).sum(0) / weights.sum())
            # A merged token keeps its B token's position (an odd index).
            assert chosen.sum() == 1 or merged.positions[b, j] % 2 == 1


def replace_tokens(state: EdgeTokens, tokens: torch.Tensor) -> EdgeTokens:
    return EdgeTokens(tokens, state.positions, state.sizes, state.keys, state.block, state.blocks)


def test_proportional_attention_treats_a_token_of_size_two_as_two_copies(tiny):
    model, _ = tiny
    layer = llava_parts(model).vision_tower.encoder.layers[0]
    x = torch.randn(1, 3, layer.self_attn.embed_dim, generator=torch.Generator().manual_seed(1))
    copies = torch.cat([x, x[:, 2:]], dim=1)
    with torch.no_grad():
        merged, _ = _proportional_block(layer, x, torch.tensor([[1.0, 1.0, 2.0]]))
        duplicated, _ = _proportional_block(layer, copies, torch.ones(1, 4))
    torch.testing.assert_close(merged, duplicated[:, :3], rtol=0, atol=1e-5)


def test_tome_leaves_n_minus_r_tokens_whose_sizes_cover_every_patch(tiny):
    model, pixels = tiny
    out = edge_vision_tokens(model, pixels, chain(tome={"r": 6}), SEED)
    for where, sizes in zip(out.positions, out.sizes, strict=True):
        assert where.numel() == 10 and sizes.sum() == 16 and torch.equal(where, where.sort().values)


def test_pruning_sends_the_edge_tokens_whose_position_it_keeps(tiny):
    model, pixels = tiny
    out = edge_vision_tokens(model, pixels, chain(tome={"r": 4}, shuffle={}), SEED)
    keep = [torch.arange(0, 16, 2)] * 4
    rows, positions = select_sent(out, keep, 16)
    for tokens, where, all_tokens, all_where in zip(rows, positions, out.tokens, out.positions, strict=True):
        assert set(where.tolist()) == set(all_where.tolist()) & set(range(0, 16, 2))
        assert torch.equal(tokens, all_tokens[torch.isin(all_where, where)])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"privacy.defenses": "tome", "privacy.tome.r": 0}, "privacy.tome.r"),
        ({"privacy.defenses": "tome", "privacy.tome.r": 9}, "privacy.tome.r"),
        ({"privacy.defenses": "drop", "privacy.drop.r": 16}, "privacy.drop.r"),
        ({"privacy.defenses": "shuffle", "privacy.shuffle.block": 2}, "privacy.shuffle.block"),
        ({"paradigm": "fl", "privacy.defenses": "shuffle"}, "privacy.defenses"),
    ],
)
def test_the_run_config_refuses_an_edge_setting_the_tower_cannot_run(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"output.name": "x", "model.profile": "tiny", **overrides})
