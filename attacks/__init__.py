"""Attacks on what the server observed: FSHA, FORA, iDLG, MIA, ActInv, SARA, and the membership audit of
a released task vector (mtv_mia), behind one interface and a registry.

    from attacks import AttackerKnowledge, Recording, build_attack
    attack = build_attack("fora", knowledge, decoder_steps=2000).fit(aux_samples)
    result = attack.run(Recording.open(run_folder), truth)   # truth: attacks.truth.RunTruth

`python -m attacks --help` replays an attack against a recorded run folder. Every module of the
package is imported here, so an attack's module registers it by being in the package.
"""

from attacks.base import (
    ATTACKS,
    Attack,
    AttackResult,
    Truth,
    attack_class,
    available_attacks,
    build_attack,
    register_attack,
)
from attacks.knowledge import AttackerKnowledge
from attacks.recording import (
    MissingObservationError,
    RecordedTransfer,
    Recorder,
    Recording,
)
from registry import import_modules

import_modules(__name__)

__all__ = [
    "ATTACKS",
    "Attack",
    "AttackResult",
    "AttackerKnowledge",
    "MissingObservationError",
    "RecordedTransfer",
    "Recorder",
    "Recording",
    "Truth",
    "attack_class",
    "available_attacks",
    "build_attack",
    "register_attack",
]
