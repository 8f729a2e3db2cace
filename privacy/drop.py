"""Random token dropping at the vision edge (seed 002): r tokens fewer after every vision block.

`drop` removes `r` of each image's patch tokens, chosen uniformly at random per
(client, round, step) from the defense seed, after each block's attention; the rest
keep their order. After b blocks an image holds N − b·r tokens. Random per step, so
the tower runs on every step (nothing about it can be cached per image).
"""

from dataclasses import dataclass

import torch

from privacy.base import Defended, DefenseSeed, OptionError, register_defense
from privacy.edge import EdgeDefense, EdgeTokens


@dataclass
class DropOptions:
    # Tokens dropped from each image after each vision block.
    r: int = 16

    def validate(self) -> None:
        if not (isinstance(self.r, int) and self.r >= 1):
            raise OptionError("r", self.r, "an integer >= 1")


class TokenDrop(EdgeDefense):
    name = "drop"
    Options = DropOptions
    strength = "r"
    random = True
    removes_tokens = True

    def check(self, patches: int, blocks: int) -> None:
        if patches - blocks * self.options.r < 1:
            raise OptionError("r", self.options.r, f"at most {(patches - 1) // blocks}: {blocks} blocks of "
                              f"{patches} patches must leave a token")

    def apply(self, payload: EdgeTokens, seed: DefenseSeed) -> Defended[EdgeTokens]:
        # One generator per block, so the draw at block b does not depend on the chain before it.
        generator = seed.generator(f"{self.name}/{payload.block}")
        batch, count = payload.positions.shape
        kept = [torch.randperm(count, generator=generator)[self.options.r:].sort().values for _ in range(batch)]
        kept_tokens = payload.take(torch.stack(kept).to(payload.tokens.device))
        return Defended(kept_tokens, metrics={"dropped": float(self.options.r)})


register_defense(TokenDrop)
