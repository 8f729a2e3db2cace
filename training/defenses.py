"""The run's defenses at the cut, built from its config (`privacy.*`, checked by config.load_config).

The client applies the chain (clients.split): ACTIVATION and LOSS defenses to each
activation it sends at the first cut (training and evaluation alike: the evaluation
activations cross the same wire), GRADIENT defenses to the gradient a USL client
returns at CB. `describe_defenses` is what status.json and the recording's header
record of them; `describe_dp` what they record of the run's differential privacy
(privacy.dp: Flower's mechanisms wrap the FL strategy and the ClientApp instead).
"""

from dataclasses import asdict
from typing import Any

from config import SimConfig
from privacy import DefenseChain, parse_defense_names


def build_defenses(config: SimConfig) -> DefenseChain:
    names = parse_defense_names(config.privacy.defenses)
    return DefenseChain.build(names, {name: getattr(config.privacy, name) for name in names}, seed=config.privacy.seed)


def describe_defenses(config: SimConfig) -> list[dict[str, Any]]:
    return build_defenses(config).describe()


def describe_dp(config: SimConfig) -> dict[str, Any] | None:
    """privacy.dp's options when a mode is on, privacy.mtv's under paradigm mtv (None: no differential privacy)."""
    if not config.paradigm_spec.trains:
        return {"mechanism": "dp-mtv", **asdict(config.privacy.mtv)}
    return asdict(config.privacy.dp) if config.privacy.dp.active else None
