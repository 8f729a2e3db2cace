"""Token shuffling at the vision edge (seed 002): the visual tokens leave in a random order.

`shuffle` permutes each image's patch tokens at vision block `block` with a permutation
drawn per (client, round, step) from the defense seed, and the sent tokens keep that
order. After the embeddings add their positions, a CLIP block treats its tokens as a
set (attention and MLP are permutation-equivariant), so alone it is the same as
permuting the tower's output; the block matters only when a later ToMe block matches
tokens by their order. The decoder reads the shuffled rows at its own rotary
positions, so the answer depends on the order (its accuracy cost is measured, not assumed).
"""

from dataclasses import dataclass

import torch

from privacy.base import Defended, DefenseSeed, OptionError, register_defense
from privacy.edge import EdgeDefense, EdgeTokens


@dataclass
class ShuffleOptions:
    # The vision block after whose attention the tokens are permuted (1-based); -1: the last.
    block: int = -1

    def validate(self) -> None:
        if not (self.block == -1 or self.block >= 1):
            raise OptionError("block", self.block, "-1 (the last block) or a block number >= 1")


class TokenShuffle(EdgeDefense):
    name = "shuffle"
    Options = ShuffleOptions
    # A permutation is all or nothing.
    strength = None
    random = True
    reorders = True

    def check(self, patches: int, blocks: int) -> None:
        if self.options.block > blocks:
            raise OptionError("block", self.options.block, f"-1 or 1..{blocks} (the vision blocks that run)")

    def apply(self, payload: EdgeTokens, seed: DefenseSeed) -> Defended[EdgeTokens]:
        at = payload.blocks if self.options.block == -1 else self.options.block
        if payload.block != at:
            return Defended(payload)
        generator = seed.generator(self.name)
        batch, count = payload.positions.shape
        order = torch.stack([torch.randperm(count, generator=generator) for _ in range(batch)]).to(payload.tokens.device)
        return Defended(payload.take(order))


register_defense(TokenShuffle)
