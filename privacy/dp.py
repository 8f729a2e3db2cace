"""Differential privacy with a guarantee for FedAvg: its options, the calibrated noise and the budget.

The mechanisms are Flower's own: server-side fixed or adaptive clipping wrap the FL strategy
(strategies.dp), client-side fixed clipping and local DP are client mods (clients.app). What
they share lives here: the options (`privacy.dp.<option>`, checked before any model loads), the
noise multiplier calibrated from a target (ε, δ) before the run, and the budget spent after
each round, kept by Flower's RDP accountant (backed by Google's dp-accounting).

What is accounted, and why that way:
- The unit of privacy is a client (user-level DP): neighbouring federations differ by one
  client's data (add or remove one). `delta` must then be below 1 / clients.count.
- Each round is one Gaussian release of noise multiplier z (noise std / clipping norm, on the
  sum of the round's clipped updates). Under clients.sampling = fixed the rounds compose without
  amplification by sampling: the round's clients are a fixed-size draw from a seeded generator
  (strategies.fl.WireFedAvg.sampled_nodes), not the Poisson sample amplification assumes, and
  no amplification is an upper bound for any sampling. Under poisson each client joins a round
  by its own coin of probability q = clients.fraction_train and the round is averaged over the
  expected cohort q·N, whoever came (McMahan et al. 2018's fixed denominator): each round is a
  Poisson-subsampled Gaussian of multiplier z, which the accountant amplifies.
- A fixed-size round averaged over fewer clients than were sampled (a fault) has less noise per
  client: its release is composed at z · kept / sampled. A poisson round's denominator does not
  move, nor its noise per client.
- Local DP noises each client's own update, so each client spends the per-round release; the
  budget reported is that of a client that trains in every round (an upper bound for all).
- Adaptive clipping spends part of z on the noisy count of clipped updates (Andrew et al.):
  the update noise is z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2), and z is what the accountant composes.
"""

import functools
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from privacy.base import OptionError
from vlm.paradigms import PARADIGMS

OFF = "off"
CENTRAL = "central"
CENTRAL_ADAPTIVE = "central-adaptive"
CENTRAL_CLIENT_CLIPPING = "central-client-clipping"
LOCAL = "local"
SGD = "sgd"


# Each mode: what it does, whether the server (not the client) adds the noise, and the property
# (vlm.paradigms.Paradigm) a paradigm needs for the mode to apply (None: every paradigm).
MODES: dict[str, tuple[str, bool, str | None]] = {
    OFF: ("no differential privacy", False, None),
    CENTRAL: ("the server clips each client's update to `clip` and noises their average", True, "averages_updates"),
    CENTRAL_ADAPTIVE: ("as central, with the clipping norm adapted to a quantile of the update norms", True,
                       "averages_updates"),
    CENTRAL_CLIENT_CLIPPING: ("each client clips its update to `clip`, the server noises the average", True,
                              "averages_updates"),
    LOCAL: ("each client clips its update to `clip` and noises it before it leaves", False, "averages_updates"),
    SGD: ("DP-SGD: each client clips each sample's gradient to `clip` and noises their sum (privacy.dp_sgd)", False,
          "trains"),
}


def mode_paradigms(mode: str) -> tuple[str, ...]:
    """The paradigms `mode` applies to."""
    needs = MODES[mode][2]
    return tuple(paradigm.name for paradigm in PARADIGMS if needs is None or getattr(paradigm, needs))


# Noise multipliers tried while calibrating to a target epsilon: beyond the upper end the
# updates are noise (std 1000× the clipping norm on their sum) and the target is refused.
_CALIBRATION_RANGE = (1e-3, 1e3)


@dataclass
class DPOptions:
    # off | central (server-side fixed clipping) | central-adaptive (server-side adaptive
    # clipping) | central-client-clipping (clients clip, the server noises; the one central mode
    # that works under secure aggregation) | local (each client clips and noises its update).
    mode: str = OFF
    # L2 bound of one client's update (its change to the adapters in a round); adaptive: the start.
    clip: float = 1.0
    # z: the noise's std over the clipping norm, on the sum of a round's updates (local: on each
    # update). 0 with target_epsilon > 0: calibrated from the target before the run.
    noise_multiplier: float = 0.0
    # > 0: the (epsilon, delta) the whole run (train.rounds rounds) may spend; z is calibrated to it.
    target_epsilon: float = 0.0
    # The delta of the reported epsilon; below 1 / clients.count.
    delta: float = 1e-5
    # Adaptive clipping (Andrew et al.): the quantile of update norms the clipping norm tracks,
    # its geometric learning rate, and the noise std of the clipped count (0: sampled clients / 20).
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    clipped_count_stddev: float = 0.0
    # mode=sgd only: clip each sample's gradient and add no noise (noise_multiplier and
    # target_epsilon 0), the control that tells what clipping alone does from what privacy does;
    # such a run reports no epsilon, since it has none.
    clip_only: bool = False

    def validate(self) -> None:
        if self.mode not in MODES:
            raise OptionError("mode", self.mode, ", ".join(f"{name} ({what})" for name, (what, _, _) in MODES.items()))
        if not self.clip > 0:
            raise OptionError("clip", self.clip, "> 0")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise OptionError("noise_multiplier", self.noise_multiplier, ">= 0 (0: calibrated from target_epsilon)")
        if not (math.isfinite(self.target_epsilon) and self.target_epsilon >= 0):
            raise OptionError("target_epsilon", self.target_epsilon, ">= 0 (0: the noise_multiplier given)")
        if not 0 < self.delta < 1:
            raise OptionError("delta", self.delta, "a probability in (0, 1)")
        if not 0 <= self.target_quantile <= 1:
            raise OptionError("target_quantile", self.target_quantile, "a quantile in [0, 1]")
        if not self.clip_lr > 0:
            raise OptionError("clip_lr", self.clip_lr, "> 0")
        if self.clipped_count_stddev < 0:
            raise OptionError("clipped_count_stddev", self.clipped_count_stddev, ">= 0 (0: sampled clients / 20)")
        if self.clip_only:
            if self.mode != SGD:
                raise OptionError("clip_only", self.clip_only, f"false unless mode={SGD} (the clip-only control of DP-SGD)")
            if self.noise_multiplier or self.target_epsilon:
                raise OptionError("clip_only", self.clip_only, "false with a noise_multiplier or target_epsilon "
                                  "(the control adds no noise)")
        elif self.mode != OFF and (self.noise_multiplier > 0) == (self.target_epsilon > 0):
            raise OptionError(
                "noise_multiplier", self.noise_multiplier,
                f"> 0 or target_epsilon > 0, exactly one of them (mode={self.mode} needs noise and one way to set it; "
                f"target_epsilon={self.target_epsilon})",
            )

    @property
    def active(self) -> bool:
        return self.mode != OFF

    @property
    def federated(self) -> bool:
        """Whether the mode protects FedAvg's updates, with a user-level budget the server keeps."""
        return self.mode not in (OFF, SGD)

    @property
    def paradigms(self) -> tuple[str, ...]:
        return mode_paradigms(self.mode)

    @property
    def server_noise(self) -> bool:
        return MODES[self.mode][1]

    @property
    def server_clips(self) -> bool:
        """Whether the server clips each client's update (so it must see them one by one)."""
        return self.mode in (CENTRAL, CENTRAL_ADAPTIVE)


@dataclass(frozen=True)
class Federation:
    """What the accounting of a run depends on besides its options."""

    clients: int
    # The round's cohort (poisson: the expected one).
    sampled: int
    rounds: int
    # Each client joins a round by its own coin of probability sampled / clients (clients.sampling).
    poisson: bool = False

    @property
    def sampling_rate(self) -> float:
        return self.sampled / self.clients

    def count_stddev(self, options: DPOptions) -> float:
        """σ_b of adaptive clipping's clipped count (Flower's default: sampled clients / 20)."""
        return options.clipped_count_stddev or self.sampled / 20


def calibrate(make_accountant: Callable[[], dp_accounting.PrivacyAccountant], event: Callable[[float], dp_accounting.DpEvent],
              target_epsilon: float, delta: float, bracket: tuple[float, float], budget: str) -> float:
    """The smallest noise multiplier in `bracket` whose `event` spends at most (target_epsilon,
    delta) on a fresh accountant, by dp-accounting's calibration; OptionError naming the
    `budget` ("3 rounds") when even the bracket's most noise spends more."""
    low, high = bracket
    spent = make_accountant().compose(event(high)).get_epsilon(delta)
    if spent > target_epsilon:
        raise OptionError("target_epsilon", target_epsilon, f"a budget {budget} can meet with noise multiplier <= "
                          f"{high:g} at delta={delta:g} (that much noise spends epsilon={spent:.3g})")
    return float(dp_accounting.calibrate_dp_mechanism(
        make_accountant, event, target_epsilon, delta, dp_accounting.ExplicitBracketInterval(low, high), tol=1e-4))


# Cached: a sweep validates every point (seeds share a budget) and a run validates again before it
# starts, and one calibration costs seconds, tens of seconds at small Poisson sampling rates.
@functools.lru_cache(maxsize=256)
def calibrate_noise_multiplier(target_epsilon: float, delta: float, rounds: int, sampling_rate: float = 1.0) -> float:
    """The smallest z whose `rounds` Gaussian releases, each Poisson-subsampled at `sampling_rate`
    (1: no sampling), spend at most (target_epsilon, delta), by dp-accounting's calibration over its
    RDP accountant (the one that keeps the budget)."""

    def release(z: float) -> dp_accounting.DpEvent:
        gaussian = dp_accounting.GaussianDpEvent(z)
        return gaussian if sampling_rate == 1 else dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)

    return calibrate(
        lambda: dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
        lambda z: dp_accounting.SelfComposedDpEvent(release(z), rounds),
        target_epsilon, delta, _CALIBRATION_RANGE,
        f"{rounds} rounds" + (f" sampled at rate {sampling_rate:g}" if sampling_rate < 1 else ""))


def noise_multiplier(options: DPOptions, federation: Federation) -> float:
    """The run's z for a federated mode, checked against what the mode can deliver (OptionError
    when it cannot); DP-SGD's is each client's (privacy.dp_sgd)."""
    if not options.federated:
        return 0.0
    if options.delta >= 1 / federation.clients:
        raise OptionError(
            "delta", options.delta,
            f"< 1/clients.count = {1 / federation.clients:.3g} (a delta that large lets a mechanism publish one "
            "client's update outright)",
        )
    z = options.noise_multiplier or calibrate_noise_multiplier(
        options.target_epsilon, options.delta, federation.rounds, federation.sampling_rate if federation.poisson else 1.0)
    if options.mode == CENTRAL_ADAPTIVE and z >= 2 * federation.count_stddev(options):
        key, value = ("target_epsilon", options.target_epsilon) if options.target_epsilon else ("noise_multiplier", z)
        raise OptionError(
            key, value,
            f"a noise multiplier below 2·σ_b = {2 * federation.count_stddev(options):.3g} under mode=central-adaptive "
            f"(z={z:.3g}: the clipped count's noise σ_b would take all of it; raise privacy.dp.clipped_count_stddev, "
            "sample more clients or use mode=central)",
        )
    return z


def seed_numpy(*key: Any) -> None:
    """Seed numpy's global generator, which Flower's DP wrappers and mods draw their noise from,
    from `key` (stable across processes: a run and its resume draw the same noise)."""
    digest = hashlib.sha256(json.dumps([str(part) for part in key]).encode()).digest()
    np.random.seed(int.from_bytes(digest[:4], "little"))


def local_dp_epsilon(z: float, delta: float) -> float:
    """The per-release epsilon that makes Flower's LocalDpMod (std = clip · √(2 ln(1.25/δ)) / ε,
    with the clipping norm as sensitivity) add noise of std z · clip."""
    return math.sqrt(2 * math.log(1.25 / delta)) / z


class PrivacyBudget:
    """The (epsilon, delta) a run has spent: each round's release composed by Flower's RDP
    accountant; its state goes into the round's checkpoint, so a resumed run goes on spending."""

    def __init__(self, options: DPOptions, federation: Federation) -> None:
        self.options, self.federation = options, federation
        self.noise_multiplier = noise_multiplier(options, federation)
        self.accountant = RdpAccountant(PrivacyConfig(
            target_delta=options.delta,
            population_size=federation.clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.POISSON if federation.poisson else SamplingMethod.NO_AMPLIFICATION,
        ))

    def release(self, kept: int, sampled: int) -> dict[str, float]:
        """Compose one round's release, averaged over `kept` of the `sampled` clients; the
        budget spent so far, as the round's metrics."""
        if self.federation.poisson:
            self.accountant.compose(GaussianPrivacyEvent(self.noise_multiplier, sample_size=self.federation.sampled,
                                                         population_size=self.federation.clients))
        elif kept:
            z = self.noise_multiplier if not self.options.server_noise else self.noise_multiplier * kept / sampled
            self.accountant.compose(GaussianPrivacyEvent(z, sample_size=kept, population_size=self.federation.clients))
        return self.spent()

    def spent(self) -> dict[str, float]:
        releases = self.accountant.num_releases
        epsilon = self.accountant.get_epsilon(self.options.delta) if releases else 0.0
        return {"dp_epsilon": epsilon, "dp_delta": self.options.delta, "dp_releases": releases,
                "dp_noise_multiplier": self.noise_multiplier}

    def state_dict(self) -> dict[str, Any]:
        return self.accountant.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state)
