"""Defenses at the cut: one interface (privacy.base), one module per defense, each registered by name.

Every module of the package is imported here, so a defense's module registers it by being in
the package. The run config's `privacy.defenses` names the active ones in order and
`privacy.<name>.<option>` sets their options (training.defenses builds the chain);
`qpriv-privacy paf` analyses how hard each layer of a model is to invert.
"""

from privacy.base import (
    ACTIVATION,
    DEFENSES,
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
    client_stages,
    defense_class,
    defense_names,
    parse_defense_names,
    register_defense,
    stage_paradigms,
)
from registry import import_modules, options_from

import_modules(__name__)

__all__ = [
    "ACTIVATION", "DEFENSES", "EDGE", "EVAL", "GRADIENT", "LOSS", "STAGES", "TRAIN", "Defended", "Defense", "DefenseChain",
    "DefenseSeed", "OptionError", "Payload", "client_stages", "defense_class", "defense_names", "options_from",
    "parse_defense_names", "register_defense", "stage_paradigms",
]
