"""Attacks on what the server observed: FSHA, FORA, iDLG, MIA, ActInv, SARA, and the membership audit of
a released task vector (mtv_mia), behind one interface and a registry.

    from attacks import AttackerKnowledge, Recording, build_attack
    attack = build_attack("fora", knowledge, decoder_steps=2000).fit(aux_samples)
    result = attack.run(Recording.open(run_folder), truth)   # truth: attacks.truth.RunTruth

`python -m attacks --help` replays an attack against a recorded run folder.
"""

from attacks.base import (
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

# Importing an attack module registers it.
from attacks import actinv, fora, fsha, idlg, mia, mtv_mia, sara  # noqa: F401  isort: skip

__all__ = [
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
