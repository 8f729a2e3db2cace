"""Sparsification of what a client sends (seed 001's baseline defense, and top-k on gradients).

`sparsify` zeroes, in each sample's activation at the first cut, the `ratio` share of
its elements with the smallest magnitude (level "element", the paper's default) or of
its rows with the smallest L2 norm (level "token"); exactly round(ratio · count) of
them, ties broken by position. Per sample, so a sample's payload does not depend on
what else shares its batch. `grad_topk` keeps the largest-magnitude (1 − ratio) share
of each sample's gradient at CB and zeroes the rest (top-k gradient sparsification).
"""

from dataclasses import dataclass

import torch

from privacy.base import ACTIVATION, GRADIENT, Defended, Defense, DefenseSeed, OptionError, Payload, register_defense

LEVELS = ("element", "token")


@dataclass
class SparsifyOptions:
    # Share zeroed (the paper's grid: 0.1, 0.3, 0.5, 0.7, 0.9).
    ratio: float = 0.5
    # "element": the smallest-magnitude elements; "token": the lowest-norm rows.
    level: str = "element"

    def validate(self) -> None:
        if not 0 <= self.ratio < 1:
            raise OptionError("ratio", self.ratio, "a share in [0, 1)")
        if self.level not in LEVELS:
            raise OptionError("level", self.level, ", ".join(LEVELS))


def keep_largest(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """A 0/1 mask of `scores`' shape keeping all but the round(ratio · n) smallest."""
    flat = scores.flatten()
    kept = flat.numel() - round(ratio * flat.numel())
    mask = torch.zeros_like(flat)
    # A stable descending sort breaks ties by position, so the count is exact.
    mask[flat.argsort(descending=True, stable=True)[:kept]] = 1
    return mask.view(scores.shape)


def sparsify(payload: Payload, ratio: float, level: str) -> Defended:
    masks = []
    with torch.no_grad():
        for rows in payload.samples():
            if level == "element":
                masks.append(keep_largest(rows.abs(), ratio))
            else:
                masks.append(keep_largest(rows.norm(dim=-1), ratio).unsqueeze(-1).expand_as(rows))
        mask = torch.cat(masks).to(payload.rows.dtype)
    return Defended(payload.rows * mask, metrics={"zeroed_share": float(1 - mask.mean())})


class Sparsification(Defense):
    name = "sparsify"
    stage = ACTIVATION
    Options = SparsifyOptions
    strength = "ratio"

    def apply(self, payload: Payload, seed: DefenseSeed) -> Defended:
        return sparsify(payload, self.options.ratio, self.options.level)


@dataclass
class TopKOptions:
    # Share of each sample's gradient elements zeroed (the smallest in magnitude).
    ratio: float = 0.9

    def validate(self) -> None:
        if not 0 <= self.ratio < 1:
            raise OptionError("ratio", self.ratio, "a share in [0, 1)")


class GradientTopK(Defense):
    name = "grad_topk"
    stage = GRADIENT
    Options = TopKOptions
    strength = "ratio"

    def apply(self, payload: Payload, seed: DefenseSeed) -> Defended:
        return sparsify(payload, self.options.ratio, "element")


register_defense(Sparsification)
register_defense(GradientTopK)
