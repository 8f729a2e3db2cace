"""Gaussian noise on what a client sends (seed 001's baseline defense).

`noise` adds N(0, variance·I) to every element of the activation at the first cut (the
paper's grid: variance 1e-4, 1e-3, 1e-2, 1e-1, 1; absolute, as in the paper, so what a
variance means depends on the activation's scale: the recorded `noise.snr_db` says);
`grad_noise` does the same to the gradient a USL client returns at CB, against label
recovery from that gradient (iDLG).
"""

from dataclasses import dataclass

import torch

from privacy.base import ACTIVATION, GRADIENT, Defended, Defense, DefenseSeed, OptionError, Payload, register_defense


@dataclass
class NoiseOptions:
    # Variance of the added noise per element (absolute).
    variance: float = 1e-2

    def validate(self) -> None:
        if not self.variance > 0:
            raise OptionError("variance", self.variance, "> 0")


def add_gaussian(rows: torch.Tensor, variance: float, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    # Drawn on the CPU: the same seed gives the same noise on every device.
    noise = torch.randn(rows.shape, generator=generator, dtype=torch.float32).to(rows.device, rows.dtype)
    noise = noise * variance**0.5
    power = rows.detach().float().pow(2).mean()
    snr_db = float(10 * torch.log10(power / noise.float().pow(2).mean().clamp_min(1e-30)))
    return rows + noise, {"snr_db": snr_db}


class GaussianNoise(Defense):
    name = "noise"
    stage = ACTIVATION
    Options = NoiseOptions
    strength = "variance"
    random = True

    def apply(self, payload: Payload, seed: DefenseSeed) -> Defended:
        rows, metrics = add_gaussian(payload.rows, self.options.variance, seed.generator(self.name))
        return Defended(rows, metrics=metrics)


class GradientNoise(GaussianNoise):
    name = "grad_noise"
    stage = GRADIENT


register_defense(GaussianNoise)
register_defense(GradientNoise)
