"""Token merging (ToMe, Bolya et al. 2023) at the vision edge (seed 002): r tokens fewer per block.

`tome` merges `r` pairs of each image's patch tokens after each block's attention by
bipartite soft matching on the attention keys: the tokens alternate into sets A and
B, each A token proposes its most similar B token (cosine of the keys, averaged over
heads), and the r best-matched A tokens are merged into their B tokens as size-weighted
means; the sizes add, and the edge's attention is proportional to them (privacy.edge).
The CLS token never merges (the edge keeps it out of every operation). A merged token
keeps its B token's position. Deterministic given the image. Written from the paper
(its reference code is not a maintained package).
"""

from dataclasses import dataclass

import torch

from privacy.base import Defended, DefenseSeed, OptionError, register_defense
from privacy.edge import EdgeDefense, EdgeTokens


@dataclass
class ToMeOptions:
    # Tokens merged away from each image after each vision block.
    r: int = 16

    def validate(self) -> None:
        if not (isinstance(self.r, int) and self.r >= 1):
            raise OptionError("r", self.r, "an integer >= 1")


def bipartite_merge(state: EdgeTokens, r: int) -> EdgeTokens:
    """ToMe's bipartite soft matching: `r` tokens of set A merged into set B; unmerged A then B."""
    metric = state.keys / state.keys.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    a, b = metric[:, ::2], metric[:, 1::2]
    r = min(r, a.shape[1])
    best, best_b = (a @ b.transpose(1, 2)).max(dim=-1)
    ranked = best.argsort(dim=-1, descending=True, stable=True)
    merged, unmerged = ranked[:, :r], ranked[:, r:]
    target = best_b.gather(1, merged)

    def pick(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))

    def merge_sum(x: torch.Tensor) -> torch.Tensor:
        src, dst = x[:, ::2], x[:, 1::2]
        index = target.view(*target.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        dst = dst.scatter_add(1, index, pick(src, merged))
        return torch.cat([pick(src, unmerged), dst], dim=1)

    sizes = merge_sum(state.sizes)
    tokens = merge_sum(state.tokens * state.sizes[..., None]) / sizes[..., None]
    keys = merge_sum(state.keys * state.sizes[..., None]) / sizes[..., None]
    positions = torch.cat([pick(state.positions[:, ::2], unmerged), state.positions[:, 1::2]], dim=1)
    return EdgeTokens(tokens, positions, sizes, keys, state.block, state.blocks)


class TokenMerge(EdgeDefense):
    name = "tome"
    Options = ToMeOptions
    strength = "r"
    reads_keys = True
    removes_tokens = True

    def check(self, patches: int, blocks: int) -> None:
        # Later blocks merge at most half the tokens left (set A's size), as ToMe's own code caps r.
        if self.options.r > patches // 2:
            raise OptionError("r", self.options.r, f"at most {patches // 2} (half the {patches} patches)")

    def apply(self, payload: EdgeTokens, seed: DefenseSeed) -> Defended[EdgeTokens]:
        before = payload.positions.shape[1]
        merged = bipartite_merge(payload, self.options.r)
        return Defended(merged, metrics={"merged": float(before - merged.positions.shape[1])})


register_defense(TokenMerge)
