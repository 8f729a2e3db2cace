"""Secure aggregation with Flower's SecAgg+ protocol, for FedAvg's updates and federated DP-MTV's
task-vector shares: its options (`privacy.secagg.<option>`).

Under SecAgg+ a client's adapters leave as a masked integer vector: quantised to
`quantization_range` levels over [-clipping_range, clipping_range], weighted by its example
count (at most `max_weight`), masked by pairwise masks shared with `shares - 1` neighbours and
a private one. The server can unmask only the sum of the surviving clients' vectors, and a
client that drops out after the keys were shared is recovered from `threshold` of its shares.
The server (strategies.secagg) runs Flower's `SecAggPlusWorkflow`, the clients Flower's
`secaggplus_mod` (clients.app).

What it does not protect: the aggregate (FedAvg's global update, which every client receives
anyway), and the per-client scalars the protocol reports in the clear (example count, loss).
It adds no noise: with privacy.dp it composes with the modes whose noise the server can add to
the aggregate alone (central-client-clipping) or that noise on the client (local).
"""

from dataclasses import dataclass

from privacy.base import OptionError

# Flower's SecAgg+ draws masks modulo 2**32 (its largest supported modulus).
MODULUS_RANGE = 2**32


@dataclass
class SecAggOptions:
    # Run FL's training rounds through SecAgg+.
    enabled: bool = False
    # Each client's secret is split into this many shares, one per neighbour and one it keeps
    # (at least 3, at most the sampled clients, odd below them); 0: every sampled client (a
    # complete graph).
    shares: int = 0
    # Shares that rebuild a dropped client's masks (below the shares); 0: a majority of the
    # shares (the largest number of colluding neighbours it withstands is threshold - 1).
    threshold: int = 0
    # Quantisation: each adapter value clipped to [-clipping_range, clipping_range] and mapped
    # to one of quantization_range integers (the aggregate's error is about range / levels).
    clipping_range: float = 8.0
    quantization_range: int = 2**22
    # The largest example count a client may weight its vector by; 0: the examples each client
    # trains on in a round (train.steps_per_round × train.batch_size), or under MTV its chunks. The vector is scaled by
    # weight / max_weight before quantisation, so a loose bound costs precision in proportion.
    max_weight: float = 0.0

    def validate(self) -> None:
        if self.shares < 0 or (self.shares and self.shares < 3):
            raise OptionError("shares", self.shares, "0 (every sampled client) or an integer >= 3")
        if self.threshold < 0 or (self.threshold and self.threshold < 2):
            raise OptionError("threshold", self.threshold, "0 (a majority of the shares) or an integer >= 2")
        if not self.clipping_range > 0:
            raise OptionError("clipping_range", self.clipping_range, "> 0")
        if not 1 < self.quantization_range < MODULUS_RANGE:
            raise OptionError("quantization_range", self.quantization_range, f"an integer in (1, {MODULUS_RANGE})")
        if self.max_weight < 0:
            raise OptionError("max_weight", self.max_weight, ">= 0 (0: the examples a client trains on per round)")

    def resolved(self, sampled: int, weight: float) -> tuple[int, int, float]:
        """(shares, threshold, max_weight) for rounds of `sampled` clients each weighting by
        `weight` examples; OptionError when the protocol cannot run so."""
        if sampled < 3:
            raise OptionError("enabled", self.enabled, f"false with {sampled} clients per round (Flower's SecAgg+ "
                              "needs 3 or more: with 2, each would learn the other's update from the sum)")
        shares = self.shares or sampled
        if shares > sampled or (shares < sampled and shares % 2 == 0):
            raise OptionError("shares", self.shares, f"an odd number of shares in [3, {sampled}] (the sampled clients), or {sampled}")
        threshold = self.threshold or shares // 2 + 1
        if not 2 <= threshold < shares:
            raise OptionError("threshold", self.threshold, f"an integer in [2, {shares - 1}] (below the {shares} shares)")
        max_weight = self.max_weight or weight
        if weight > max_weight:
            raise OptionError("max_weight", self.max_weight,
                              f">= {weight:g}, the most a client weights its vector by (FL: its examples in a round, "
                              "train.steps_per_round × train.batch_size; MTV: its share of privacy.mtv.chunks)")
        return shares, threshold, max_weight
