"""The vision edge: the client's vision tower run block by block, with token operations inside it.

EDGE-stage defenses (privacy.shuffle, privacy.tome, privacy.drop) change which visual
tokens the tower forms, before pruning and the projector. The tower runs as CLIP runs
it, with two additions that are exact no-ops when no defense acts:

- each token carries a size (how many patches it stands for) and attention is
  proportional, softmax(q·kᵀ/√d + log size), as ToMe needs for merged tokens;
- after each block's attention and before its MLP (where ToMe merges) every EDGE
  defense sees the patch tokens as `EdgeTokens` and returns them changed. The CLS
  token is never handed to a defense: it stays, attends and is dropped at the end, as
  LLaVA's "default" feature selection drops it.

Each token keeps a position, the patch it stands for (a merged token: the one that
absorbed the others), which is how pruning composes with the edge (`select_sent`: a
token is sent when QPriv-VL keeps its position; QPriv-VL scores the patches on the
undefended tower's cached features, so its keep set does not depend on the edge) and
what the attacks' truth scores position recovery against. Unless a shuffle ran, the
sent tokens are in patch order, as without the edge.
"""

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from privacy.base import EDGE, Defended, Defense, DefenseChain, DefenseSeed
from vlm.segments import llava_parts


@dataclass(frozen=True)
class EdgeTokens:
    """The patch tokens of a batch of images at one block of the vision tower.

    Every image holds the same number of tokens (each operation removes as many from each)."""

    tokens: torch.Tensor  # [B, N, D]
    # The patch each token stands for [B, N] (long), and how many patches it covers [B, N].
    positions: torch.Tensor
    sizes: torch.Tensor
    # The block's attention keys, averaged over heads [B, N, Dh]: ToMe's similarity (None when
    # no defense in the chain reads them).
    keys: torch.Tensor | None
    block: int  # 1-based: the block whose attention just ran
    blocks: int  # how many blocks run (up to the vision feature layer)

    def take(self, index: torch.Tensor) -> "EdgeTokens":
        """The tokens at `index` [B, M] of each image, in that order."""
        gather = lambda x: x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))  # noqa: E731
        return replace(self, tokens=gather(self.tokens), positions=gather(self.positions),
                       sizes=gather(self.sizes), keys=None if self.keys is None else gather(self.keys))


class EdgeDefense(Defense):
    """A defense inside the vision tower: `apply` takes `EdgeTokens` and returns them in `Defended`."""

    stage = EDGE
    # Whether the tokens leave out of patch order (then the sent order is the tower's).
    reorders = False
    # Whether `apply` reads `EdgeTokens.keys` (only then does the edge compute them).
    reads_keys = False
    # Whether it leaves fewer tokens than patches (then a sample's visual row count is not N).
    removes_tokens = False

    @abstractmethod
    def apply(self, payload: EdgeTokens, seed: DefenseSeed) -> Defended[EdgeTokens]:
        """The tokens after this block's operation, and what the operation measured."""

    def check(self, patches: int, blocks: int) -> None:
        """Refuse, naming the option, a setting this tower (patches, blocks) cannot run."""

    def vision_tower(self, tower: nn.Module) -> nn.Module:
        """The tower the edge runs (a defense that replaces the client's model returns its own)."""
        return tower


@dataclass(frozen=True)
class EdgeOutput:
    """Per image: the tower's output tokens [N', Dv] in the order they would be sent, the patch
    each stands for [N'] and its size [N']; with the EDGE defenses' metrics (summed over blocks)."""

    tokens: list[torch.Tensor]
    positions: list[torch.Tensor]
    sizes: list[torch.Tensor]
    metrics: dict[str, float]


def check_edge(chain: DefenseChain, patches: int, blocks: int) -> None:
    for defense in chain.at(EDGE):
        defense.check(patches, blocks)


def _proportional_block(layer: nn.Module, hidden: torch.Tensor, sizes: torch.Tensor,
                        keys: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A CLIP encoder layer's attention half with log-size attention bias; returns the hidden
    states after the attention residual and (with `keys`) the keys averaged over heads."""
    attention = layer.self_attn
    normed = layer.layer_norm1(hidden)
    bias = sizes.log().to(hidden.dtype)[:, None, None, :]
    out, _ = attention(hidden_states=normed, attention_mask=bias)
    if not keys:
        return hidden + out, None
    b, n, _ = normed.shape
    return hidden + out, attention.k_proj(normed).view(b, n, attention.num_heads, attention.head_dim).mean(2)


@torch.no_grad()
def edge_vision_tokens(model: nn.Module, pixel_values: torch.Tensor, chain: DefenseChain,
                       seed: DefenseSeed) -> EdgeOutput:
    """The vision tower's patch tokens for `pixel_values` with the chain's EDGE defenses inside it."""
    parts = llava_parts(model)
    config = parts.config
    if not isinstance(config.vision_feature_layer, int) or config.vision_feature_select_strategy != "default":
        raise ValueError("EDGE defenses need a single int vision_feature_layer and the 'default' feature selection "
                         f"(patch tokens only); got {config.vision_feature_layer!r}, "
                         f"{config.vision_feature_select_strategy!r}")
    defenses = chain.at(EDGE)
    tower = parts.vision_tower
    for defense in defenses:
        tower = defense.vision_tower(tower)
    layers = tower.encoder.layers
    blocks = config.vision_feature_layer % (len(layers) + 1)
    hidden = tower.pre_layrnorm(tower.embeddings(pixel_values))
    batch, count = hidden.shape[0], hidden.shape[1] - 1
    check_edge(chain, count, blocks)
    positions = torch.arange(count, device=hidden.device).expand(batch, count)
    sizes = torch.ones(batch, count + 1, device=hidden.device)
    metrics: dict[str, float] = {}
    # The keys cost one more projection per block: computed only for a defense that reads them.
    reads_keys = any(defense.reads_keys for defense in defenses)
    for block, layer in enumerate(layers[:blocks], start=1):
        hidden, keys = _proportional_block(layer, hidden, sizes, keys=reads_keys)
        if defenses:
            state = EdgeTokens(hidden[:, 1:], positions, sizes[:, 1:], None if keys is None else keys[:, 1:],
                               block, blocks)
            for defense in defenses:
                defended = defense.apply(state, seed)
                state = defended.rows
                for key, value in defended.metrics.items():
                    name = f"{defense.name}.{key}"
                    metrics[name] = metrics.get(name, 0.0) + value
            hidden = torch.cat([hidden[:, :1], state.tokens], dim=1)
            sizes = torch.cat([sizes[:, :1], state.sizes], dim=1)
            positions = state.positions
        hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
    tokens, sizes = hidden[:, 1:], sizes[:, 1:]
    if not any(defense.reorders for defense in defenses):
        order = positions.argsort(dim=1)
        tokens = tokens.gather(1, order[..., None].expand_as(tokens))
        positions, sizes = positions.gather(1, order), sizes.gather(1, order)
    return EdgeOutput(list(tokens.unbind(0)), list(positions.unbind(0)), list(sizes.unbind(0)), metrics)


def select_sent(output: EdgeOutput, keep: Sequence[torch.Tensor], patches: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per image, the edge's tokens whose position pruning keeps (in the edge's order), and those positions."""
    tokens, positions = [], []
    for rows, where, kept in zip(output.tokens, output.positions, keep, strict=True):
        mask = torch.zeros(patches, dtype=torch.bool, device=where.device)
        mask[kept.to(where.device)] = True
        sent = mask[where]
        tokens.append(rows[sent])
        positions.append(where[sent])
    return tokens, positions


def edge_grid(output: EdgeOutput, patches: int) -> torch.Tensor:
    """The edge's tokens at the positions they stand for, [B, N, Dv] (zeros where none does): with
    the sent positions, what `features[b, positions]` reads as the rows the client sends."""
    grid = output.tokens[0].new_zeros(len(output.tokens), patches, output.tokens[0].shape[-1])
    for b, (tokens, where) in enumerate(zip(output.tokens, output.positions, strict=True)):
        grid[b, where] = tokens
    return grid
