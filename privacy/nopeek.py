"""NoPeek (Vepakomma et al., 2020): the client front learns activations that say little of its inputs.

A LOSS-stage defense: it leaves the payload as it is and adds `weight · dCor(X, Z)` to
the training loss of the client's front (USL: the head; SL: the client part), where X
are the front's input rows (the decoder's input embeddings: projected visual tokens
and text embeddings) and Z the rows it sends at the first cut. The paper correlates
whole flattened inputs with whole activations across a batch; here the units are the
batch's rows (tokens), because a pruned batch's samples hold different numbers of rows
and cannot be flattened to one length. At most `max_rows` rows enter the n × n
distance matrices, drawn from the step's seed.
"""

from dataclasses import dataclass

import torch

from privacy.base import LOSS, Defended, Defense, DefenseSeed, OptionError, Payload, register_defense


@dataclass
class NoPeekOptions:
    # Weight of the distance-correlation term in the front's loss.
    weight: float = 0.5
    # Rows (tokens) sampled per step for the correlation (its cost is quadratic in them).
    max_rows: int = 512

    def validate(self) -> None:
        if not self.weight > 0:
            raise OptionError("weight", self.weight, "> 0")
        if self.max_rows < 4:
            raise OptionError("max_rows", self.max_rows, ">= 4")


def _centred_distances(x: torch.Tensor) -> torch.Tensor:
    # Squared distances from the Gram matrix, clamped before the root so its gradient stays finite at 0.
    gram = x @ x.T
    squared = (gram.diagonal().unsqueeze(0) + gram.diagonal().unsqueeze(1) - 2 * gram).clamp_min(1e-12)
    d = squared.sqrt()
    return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation (Székely et al.) of paired rows x [n, p] and z [n, q], in [0, 1]."""
    a, b = _centred_distances(x.float()), _centred_distances(z.float())
    covariance = (a * b).mean()
    variances = (a * a).mean() * (b * b).mean()
    return (covariance.clamp_min(0) / variances.sqrt().clamp_min(1e-12)).clamp_min(1e-12).sqrt()


class NoPeek(Defense):
    name = "nopeek"
    stage = LOSS
    Options = NoPeekOptions
    strength = "weight"
    random = True

    def apply(self, payload: Payload, seed: DefenseSeed) -> Defended:
        payload.needs(self.name, "inputs")
        rows = payload.rows.shape[0]
        chosen = torch.randperm(rows, generator=seed.generator(self.name))[: self.options.max_rows]
        chosen = chosen.to(payload.rows.device)
        dcor = distance_correlation(payload.inputs[chosen].detach(), payload.rows[chosen])
        return Defended(payload.rows, loss=self.options.weight * dcor, metrics={"dcor": float(dcor.detach())})


register_defense(NoPeek)
