"""Replaying an attack against a recorded run folder: the Python side of `python -m attacks`.

    result = replay("~/qpriv-runs/usl-run", "fora", options={"decoder_steps": 3000})

builds what the attacker may know from the run's config (the public model with the
run's seeded adapters, tokenizer, cuts), draws its auxiliary data from the run's
`threat.aux_split` (the test split by default; training.data.RunData.auxiliary) — never
a row the clients train on or score on, nor one of their images — fits the attack,
runs it on the recording, scores it against the run's truth and saves the result
under `<run folder>/attacks/`.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attacks.base import ACTIVATION, GRADIENT, UPDATE, Attack, AttackResult, attack_class, build_attack
from attacks.context import ATTACK_FOLDER, ReplayContext
from attacks.knowledge import AttackerKnowledge, TrainingRecipe
from attacks.recording import Recording
from attacks.truth import RunTruth
from config import SimConfig, load_config
from training.data import RunData
from training.model import PartyModel, load_party_model
from vlm.profiles import get_profile

# What a run records round by round (the rest, a model or a release, has no round).
TRANSFERS = {ACTIVATION, GRADIENT, UPDATE}


def knowledge_for_run(config: SimConfig, party: PartyModel | None = None) -> AttackerKnowledge:
    """The public model with the run's seeded (untrained) adapters, its tokenizer and cuts.

    `party` is that model when the caller already holds it (a hijacking server, whose own
    adapters never train); by default it is loaded. Offline profiles without a tokenizer of
    their own use the word tokenizer the clients build from the run's data — the stand-in
    for a public tokenizer.
    """
    party = party or load_party_model(config)
    return AttackerKnowledge(
        model=party.model.eval(), tokenizer=RunData.build(config).tokenizer(party.bundle),
        preprocess_images=party.bundle.preprocess_images,
        cuts=config.cuts, instruction=party.instruction, device=party.device,
        recipe=TrainingRecipe(lr=config.train.lr, batch_size=config.train.batch_size,
                              steps=config.train.rounds * config.train.steps_per_round),
    )


# What a run's attacker knows publicly does not depend on these keys (knowledge_for_run reads
# the model, cuts, data and training recipe; the auxiliary rows the data and threat.aux_* keys).
_PRIVATE_OR_RUN_ONLY = ("pruning.", "output.", "faults.", "eval.", "wire.", "threat.model", "threat.max_",
                        "threat.fsha_")


def public_setting(config: SimConfig, *, defenses: bool = True) -> str:
    """A key equal for runs whose attackers know the same public model, cuts, recipe and
    auxiliary data: an attack fitted for one of them (`fit_for_run`) replays on all. With
    `defenses=False` the runs' defenses (privacy.*) are left out of it: an attack whose fit does
    not re-apply them (`Attack.fit_adapts_to_defenses`) fits the same on every defended run."""
    private = _PRIVATE_OR_RUN_ONLY if defenses else (*_PRIVATE_OR_RUN_ONLY, "privacy.")
    kept = {k: v for k, v in config.to_flat().items() if not k.startswith(private)}
    return json.dumps(kept, sort_keys=True)


def replay(
    run_folder: str | Path,
    attack: str | Attack,
    *,
    options: Mapping[str, Any] | None = None,
    aux_limit: int | None = None,
    node_partitions: Mapping[int, int] | None = None,
    partition: int = 0,
    output: str | Path | None = None,
    save: bool = True,
    round_: int | None = None,
) -> AttackResult:
    """Fit `attack` on auxiliary data (`aux_limit` rows; None: the run's `threat.aux_limit`, the
    public data its server had), run it on the run's recording, score and save it.

    `attack` may also be an attack already fitted for another run of the same model and cuts
    (a sweep over pruning policies fits a passive attack once); it is then only run, and
    `options` and `aux_limit` do not apply. `save=False` leaves the saving to the caller (a
    sweep saves a labelled replay under its label). `round_` replays it on that round's transfers
    only (a run that stored several rounds: threat.record_rounds), saved under `attacks/round-<r>/`."""
    folder = Path(run_folder).expanduser()
    recording = recording_at(folder, attack if isinstance(attack, str) else attack.name, round_)
    config = load_config(recording.config)
    truth = RunTruth.from_run_folder(folder, node_partitions)
    if isinstance(attack, Attack):
        instance = attack
        _check_fitted_for(instance, config)
        instance.prepare_replay(ReplayContext(folder, config, instance.knowledge, partition))
    else:
        instance = _fitted(attack, folder, config, options, aux_limit, partition)
    result = instance.run(recording, truth)
    result.details["run"] = {"folder": str(folder), "paradigm": config.paradigm,
                             "pruning": config.pruning.policy, "profile": config.model.profile}
    if round_ is not None:
        result.details["round"] = round_
    if save:
        default = folder / ATTACK_FOLDER if round_ is None else folder / ATTACK_FOLDER / f"round-{round_}"
        result.save(Path(output) if output is not None else default)
    return result


def recording_at(folder: Path, attack: str, round_: int | None) -> Recording:
    """The run's recording, or only round `round_` of it; refused, before anything is fitted,
    when it is not a run's, or when the attack reads no recorded transfer or the round stored none."""
    recording = Recording.open(folder)
    if not recording.config:
        raise ValueError(f"{recording.folder} has no run config in its header: replay needs a run's recording")
    if round_ is None:
        return recording
    check_replays_by_round(attack)
    return recording.at_round(round_)


def check_replays_by_round(attack: str) -> None:
    """Refuse a round for an attack that reads no recorded transfer (a model, a release)."""
    reads = attack_class(attack).reads
    if not set(reads) & TRANSFERS:
        raise ValueError(f"{attack} reads {', '.join(reads)}, not a recorded transfer: it has no round to be replayed at")


def fit_for_run(
    run_folder: str | Path, attack: str, *, options: Mapping[str, Any] | None = None, aux_limit: int | None = None
) -> Attack:
    """`attack` built with the run's settings and fitted on its public data, to replay on this
    run and on others of the same model and cuts (`replay(folder, attack_instance)`)."""
    folder = Path(run_folder).expanduser()
    config = load_config(json.loads((folder / "config.json").read_text())["config"])
    return _fitted(attack, folder, config, options, aux_limit, partition=0)


def _fitted(
    attack: str, folder: Path, config: SimConfig, options: Mapping[str, Any] | None, aux_limit: int | None,
    partition: int,
) -> Attack:
    knowledge = knowledge_for_run(config)
    instance = build_attack(attack, knowledge, **(attack_class(attack).options_from_run(config) | dict(options or {})))
    instance.prepare_replay(ReplayContext(folder, config, knowledge, partition))
    return instance.fit(RunData.build(config).auxiliary(config.threat.aux_limit if aux_limit is None else aux_limit))


def _check_fitted_for(attack: Attack, config: SimConfig) -> None:
    """A fitted attack carries its run's public model and cuts; another run must share them."""
    expected = (get_profile(config.model.profile).num_layers, tuple(config.cuts))
    found = (attack.knowledge.num_layers, tuple(attack.knowledge.cuts))
    if found != expected:
        raise ValueError(
            f"{attack.name} was fitted for a model of {found[0]} layers cut at {found[1]}; this run "
            f"({config.paradigm}, profile {config.model.profile!r}) has {expected[0]} layers cut at {expected[1]}"
        )
