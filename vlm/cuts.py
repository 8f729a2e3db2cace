"""Cut layers: which contiguous decoder-layer range each party owns.

One definition serves the decoder segments (who runs which layers) and LoRA
ownership (who trains and keeps which adapters), so the two cannot disagree.
"""

from collections.abc import Sequence
from dataclasses import dataclass

WHOLE_OWNERS = ("all",)
SL_OWNERS = ("client", "server")
USL_OWNERS = ("head", "body", "tail")


@dataclass(frozen=True)
class LayerSegment:
    """Decoder layers [start, stop) run and owned by `owner`."""

    owner: str
    start: int
    stop: int
    is_last: bool

    def __contains__(self, layer_index: object) -> bool:
        return isinstance(layer_index, int) and self.start <= layer_index < self.stop


def default_sl_cut(num_layers: int) -> int:
    return num_layers // 2


def default_usl_cuts(num_layers: int) -> tuple[int, int]:
    return num_layers // 4, (3 * num_layers) // 4


def validate_sl_cut(cut: int, num_layers: int) -> None:
    if not isinstance(cut, int) or not 0 < cut < num_layers:
        raise ValueError(
            f"sl_cut={cut!r} is out of range: it must be an integer with 0 < sl_cut < {num_layers} "
            f"(num_layers={num_layers}), so that both client and server run at least one layer"
        )


def validate_usl_cuts(cuts: Sequence[int], num_layers: int) -> None:
    if (
        len(cuts) != 2
        or not all(isinstance(c, int) for c in cuts)
        or not 0 < cuts[0] < cuts[1] < num_layers
    ):
        raise ValueError(
            f"usl_cuts={tuple(cuts)!r} is out of range: it must be two integers (CA, CB) with "
            f"0 < CA < CB < {num_layers} (num_layers={num_layers}), so that head, body and tail "
            "each run at least one layer"
        )


def split_layers(num_layers: int, cuts: Sequence[int]) -> tuple[LayerSegment, ...]:
    """Segments for no cut (CL/FL: one owner "all"), one cut (SL) or two cuts (USL)."""
    cuts = tuple(cuts)
    if len(cuts) == 0:
        owners = WHOLE_OWNERS
    elif len(cuts) == 1:
        validate_sl_cut(cuts[0], num_layers)
        owners = SL_OWNERS
    elif len(cuts) == 2:
        validate_usl_cuts(cuts, num_layers)
        owners = USL_OWNERS
    else:
        raise ValueError(
            f"cuts={cuts!r} has {len(cuts)} entries; allowed: 0 (whole model), 1 (SL) or 2 (USL)"
        )
    bounds = (0, *cuts, num_layers)
    return tuple(
        LayerSegment(owner=owner, start=bounds[i], stop=bounds[i + 1], is_last=i == len(owners) - 1)
        for i, owner in enumerate(owners)
    )


def segment_of_owner(segments: Sequence[LayerSegment], owner: str) -> LayerSegment:
    for segment in segments:
        if segment.owner == owner:
            return segment
    raise ValueError(f"owner={owner!r} is not part of this split; allowed: {[s.owner for s in segments]}")
