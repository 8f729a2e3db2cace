"""DP-FedAvg on the server: Flower's DP wrapper around the FL strategy, and the budget it spends.

`privacy.dp.mode` picks Flower's wrapper: server-side fixed clipping (central), server-side
adaptive clipping (central-adaptive), or client-side fixed clipping (central-client-clipping,
the clients clip with Flower's `fixedclipping_mod`). Local DP has no wrapper: the clients noise
(clients.app). In every mode the run's `PrivacyBudget` composes each round's release, its
(epsilon, delta) goes into the round's metrics and the status, and its state (with adaptive
clipping's current norm) into the round's checkpoint.

Flower's wrappers draw their noise from numpy's global generator; it is seeded from
(privacy.seed, round) just before each aggregation, so a run and its resume add the same noise.
"""

from typing import Any

from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from config import SimConfig
from config.schema import dp_federation
from privacy.dp import CENTRAL, CENTRAL_ADAPTIVE, CENTRAL_CLIENT_CLIPPING, PrivacyBudget, seed_numpy


class FederatedDP:
    """The DP of one FL run: the strategy Flower's wrapper makes of the FL strategy (`outer`,
    the one to start) and the budget its rounds spend."""

    def __init__(self, config: SimConfig, strategy: Strategy) -> None:
        self.config = config
        options = config.privacy.dp
        federation = dp_federation(config)
        self.budget = PrivacyBudget(options, federation)
        z = self.budget.noise_multiplier
        sampled = federation.sampled
        self.wrapper: Strategy | None = None
        if options.mode == CENTRAL:
            self.wrapper = DifferentialPrivacyServerSideFixedClipping(strategy, z, options.clip, sampled)
        elif options.mode == CENTRAL_CLIENT_CLIPPING:
            self.wrapper = DifferentialPrivacyClientSideFixedClipping(strategy, z, options.clip, sampled)
        elif options.mode == CENTRAL_ADAPTIVE:
            self.wrapper = DifferentialPrivacyServerSideAdaptiveClipping(
                strategy, z, sampled, initial_clipping_norm=options.clip,
                target_clipped_quantile=options.target_quantile, clip_norm_lr=options.clip_lr,
                clipped_count_stddev=federation.count_stddev(options),
            )
        self.outer = self.wrapper or strategy

    def before_aggregation(self, round_: int) -> None:
        seed_numpy("dp-fedavg", self.config.privacy.seed, round_)

    def release(self, kept: int, sampled: int) -> dict[str, float]:
        """The round's budget after its release; adaptive clipping's norm for the next round."""
        metrics = self.budget.release(kept, sampled)
        if self.wrapper is not None:
            metrics["dp_clip"] = float(self.wrapper.clipping_norm)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"budget": self.budget.state_dict()}
        if self.wrapper is not None:
            state["clip"] = float(self.wrapper.clipping_norm)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state["budget"])
        if self.wrapper is not None:
            self.wrapper.clipping_norm = state["clip"]
