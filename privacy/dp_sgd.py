"""DP-SGD on a client's own parameters (privacy.dp.mode = "sgd"): per-sample clipping and noise.

What it protects: the client's training samples in what its parameters learn from them — the
adapters an FL client sends, the weights of an SL/USL client's segments — at the sample level
(neighbouring datasets differ in one of the client's samples, replaced), with each client's
(epsilon, delta) reported after every step it takes. What it does not protect: what crosses a
cut. The activation at the first cut and USL's gradient at CB are functions of each sample
itself, not of the noised weights; privacy.defenses is what acts on them.

Per-sample gradients come from one autograd pass per sample over the batch's graph (its own
loss, or its slice of the packed rows at a cut with the gradient the server returned for it):
Opacus's GradSampleModule hooks the batch dimension of nn.Modules, which the packed rows of a
split step do not have. Each sample's gradient is clipped to `clip` (USL: the head's and the
tail's each to clip/√2, so that together they stay within clip), the clipped gradients are
summed, Gaussian noise of std z·clip is added to each segment's sum, and the result is divided by
the batch size.

Accounting: batches are drawn without replacement, of a fixed size, independently at every step
(training.batches.sampled_positions), which is what amplification by sampling assumes; each step
is a sampled Gaussian under replace-one neighbouring, where replacing one sample moves the
clipped sum by up to 2·clip, so the accountant composes noise multiplier z/2. A client's budget
depends only on how many steps it took, so it is recomputed from the step count, never stored.
"""

import functools
import math
from collections.abc import Iterable, Sequence

import torch
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

import dp_accounting

from privacy.base import OptionError
from privacy.dp import DPOptions, calibrate

_CALIBRATION_RANGE = (1e-2, 1e3)
# The RDP orders both the calibration and the budget use. The sampled-without-replacement bound
# costs more the larger the order (dp-accounting's default set reaches 256 and takes seconds per
# evaluation); up to 64 the epsilon is the full set's above 1 and within 1% down to 0.6 — and any
# set of orders gives a valid upper bound.
ORDERS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def _accountant() -> dp_accounting.rdp.RdpAccountant:
    return dp_accounting.rdp.RdpAccountant(orders=ORDERS, neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)


def _event(z: float, samples: int, batch: int, steps: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(samples, batch, dp_accounting.GaussianDpEvent(z / 2)), steps
    )


# Cached for the reason privacy.dp.calibrate_noise_multiplier is: every point of a sweep, then its run.
@functools.lru_cache(maxsize=256)
def calibrate_sample_noise(target_epsilon: float, delta: float, samples: int, batch: int, steps: int) -> float:
    """The smallest z whose `steps` DP-SGD steps (batches of `batch` drawn without replacement from a
    client's `samples`) spend at most (target_epsilon, delta) under replace-one adjacency."""
    return calibrate(_accountant, lambda z: _event(z, samples, batch, steps), target_epsilon, delta,
                     _CALIBRATION_RANGE, f"{steps} steps")


class SampleLevelDP:
    """A client's DP-SGD: its noise multiplier (given, or calibrated to the target over the
    run's steps) and its budget after a number of steps."""

    def __init__(self, options: DPOptions, samples: int, batch: int, total_steps: int) -> None:
        if options.delta >= 1 / samples:
            raise OptionError("delta", options.delta, f"< 1/{samples}, one over this client's training samples "
                              "(a delta that large lets a mechanism publish one sample outright)")
        if batch > samples:
            raise OptionError("mode", options.mode, f"off with train.batch_size={batch} above a client's {samples} samples")
        self.options, self.samples, self.batch = options, samples, batch
        self.noise_multiplier = 0.0 if options.clip_only else (
            options.noise_multiplier or calibrate_sample_noise(options.target_epsilon, options.delta, samples, batch, total_steps))


    def spent(self, steps: int) -> dict[str, float]:
        """The client's budget after `steps` DP-SGD steps, by Flower's RDP accountant (the clip-only
        control has none: no dp_epsilon)."""
        if self.options.clip_only:
            return {"dp_clip_only": 1.0, "dp_delta": self.options.delta, "dp_releases": float(steps),
                    "dp_noise_multiplier": 0.0}
        epsilon = 0.0
        if steps:
            accountant = RdpAccountant(PrivacyConfig(
                target_delta=self.options.delta, population_size=self.samples,
                neighboring_relation=NeighboringRelation.REPLACE_ONE, sampling_method=SamplingMethod.WITHOUT_REPLACEMENT,
            ), orders=ORDERS)
            accountant.compose(GaussianPrivacyEvent(self.noise_multiplier / 2, self.batch, self.samples), steps)
            epsilon = accountant.get_epsilon(self.options.delta)
        return {"dp_epsilon": epsilon, "dp_delta": self.options.delta, "dp_releases": float(steps),
                "dp_noise_multiplier": self.noise_multiplier}

    def private_gradients(
        self, params: Sequence[torch.nn.Parameter], sample_gradients: Iterable[Sequence[torch.Tensor]],
        count: int, generator: torch.Generator, *, clip: float | None = None,
    ) -> dict[str, float]:
        """Set each parameter's .grad to the noised mean of the batch's clipped per-sample gradients.

        `sample_gradients` yields each of the `count` samples' gradients for `params`; `clip`
        defaults to the options' (USL passes clip/√2 for each of its two segments). Returns the
        share of samples whose gradient the clipping shortened."""
        clip = self.options.clip if clip is None else clip
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        clipped = 0
        for sample in sample_gradients:
            grads = [g.float() for g in sample]
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            scale = min(1.0, clip / max(norm, 1e-12))
            clipped += scale < 1.0
            for acc, g in zip(total, grads, strict=True):
                acc.add_(g, alpha=scale)
        std = self.noise_multiplier * self.options.clip
        for p, acc in zip(params, total, strict=True):
            # Drawn on the CPU: the same seed gives the same noise on every device.
            noise = torch.randn(acc.shape, generator=generator, dtype=torch.float32) * std
            p.grad = ((acc.cpu() + noise) / count).to(p.device, p.dtype)
        return {"dp_clipped_share": clipped / max(count, 1)}
