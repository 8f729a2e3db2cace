"""The training paradigms: how a run's model is split between the clients and the server.

The run config's `paradigm` names one of them. What the rest of the system asks of a
paradigm is a property here (how many cuts, which segments each party holds, whether a
wire carries anything, whether clients train, whether the server sums what they send),
never its name: which defense stages a client has (privacy.base), which DP modes and
threat models apply (privacy.dp, config.threats) all follow from these.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from registry import Registry
from vlm.cuts import SL_OWNERS, USL_OWNERS, WHOLE_OWNERS


@dataclass(frozen=True)
class Paradigm:
    name: str
    # Decoder cuts: 0 (each party that trains runs the whole model), 1 (SL's C), 2 (USL's CA and CB).
    cuts: int
    # The segments (vlm.cuts owners) each party runs, trains and keeps; a server of none runs no layers.
    client_owners: tuple[str, ...]
    server_owners: tuple[str, ...] = ()
    # Whether clients and a server exchange messages (CL: one trainer holds all the data).
    wire: bool = True
    # Whether the clients train (MTV's clients build task-vector shares).
    trains: bool = True
    # Whether the server sums what its clients send (FedAvg's updates, MTV's shares): what
    # SecAgg+ hides and central DP noises.
    aggregates: bool = False

    @property
    def split(self) -> bool:
        """Whether the decoder is cut between client and server (activations cross the wire)."""
        return self.cuts > 0

    @property
    def averages_updates(self) -> bool:
        """FedAvg: the server averages the adapter updates its clients trained (and keeps the result)."""
        return self.aggregates and self.trains

    @property
    def server_computes_loss(self) -> bool:
        """Whether the server runs the decoder's last segment (SL's single cut): the answers reach it in clear."""
        return self.cuts == 1

    def cut_layers(self, sl_cut: int, usl_cuts: Sequence[int]) -> tuple[int, ...]:
        """Its decoder cuts, of SL's cut C and USL's pair (CA, CB): () without a cut."""
        return ((), (sl_cut,), tuple(usl_cuts))[self.cuts]


PARADIGMS: Registry[Paradigm] = Registry("paradigm")

# CL: one trainer holds all the data, no wire (the accuracy reference).
PARADIGMS.register(Paradigm("cl", 0, WHOLE_OWNERS, wire=False))
# FL: FedAvg over the clients' LoRA updates.
FL = PARADIGMS.register(Paradigm("fl", 0, WHOLE_OWNERS, aggregates=True))
# SL: clients take turns against one server, cut at C.
SL = PARADIGMS.register(Paradigm("sl", 1, (SL_OWNERS[0],), (SL_OWNERS[1],)))
# USL: two cuts; the server never sees inputs, labels or logits.
USL = PARADIGMS.register(Paradigm("usl", 2, (USL_OWNERS[0], USL_OWNERS[2]), (USL_OWNERS[1],)))
# MTV: federated DP-MTV (privacy.dp_mtv); clients send task-vector shares, nothing is trained.
MTV = PARADIGMS.register(Paradigm("mtv", 0, WHOLE_OWNERS, trains=False, aggregates=True))
