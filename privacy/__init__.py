"""Defenses at the cut: one interface (privacy.base), one module per defense, each registered by name.

The run config's `privacy.defenses` names the active ones in order and
`privacy.<name>.<option>` sets their options (training.defenses builds the chain);
`qpriv-privacy paf` analyses how hard each layer of a model is to invert.
"""

from privacy.base import (
    ACTIVATION,
    EDGE,
    EVAL,
    GRADIENT,
    LOSS,
    STAGES,
    TRAIN,
    Defended,
    Defense,
    DefenseChain,
    DefenseSeed,
    OptionError,
    Payload,
    defense_class,
    defense_names,
    options_from,
    parse_defense_names,
    register_defense,
)
from privacy import drop, nopeek, noise, positionless, pripert, shuffle, sparsification, tome  # noqa: F401  (each registers its defenses)

__all__ = [
    "ACTIVATION", "EDGE", "EVAL", "GRADIENT", "LOSS", "STAGES", "TRAIN", "Defended", "Defense", "DefenseChain", "DefenseSeed",
    "OptionError", "Payload", "defense_class", "defense_names", "options_from", "parse_defense_names",
    "register_defense",
]
