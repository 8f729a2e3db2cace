"""Replaying an attack against a recorded run folder: the Python side of `python -m attacks`.

    result = replay("~/qpriv-runs/usl-run", "fora", options={"decoder_steps": 3000})

builds what the attacker may know from the run's config (the public model with the
run's seeded adapters, tokenizer, cuts), draws its auxiliary data from the run's
`threat.aux_split` (the test split by default) — never a row the clients train on or
score on, nor one of their images — fits the
attack, runs it on the recording, scores it against the run's truth and saves the
result under `<run folder>/attacks/`.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attacks.base import Attack, AttackResult, attack_class, build_attack
from attacks.context import ATTACK_FOLDER, ReplayContext
from attacks.knowledge import AttackerKnowledge, TrainingRecipe
from attacks.recording import Recording
from attacks.truth import RunTruth, run_texts
from config import SimConfig, load_config
from training.model import PartyModel, load_party_model
from vlm.mini.tokenizer import build_word_tokenizer
from vlm.profiles import get_profile
from vqa import VQASample, load_vqa


def knowledge_for_run(config: SimConfig, truth: RunTruth, party: PartyModel | None = None) -> AttackerKnowledge:
    """The public model with the run's seeded (untrained) adapters, its tokenizer and cuts.

    `party` is that model when the caller already holds it (a hijacking server, whose own
    adapters never train); by default it is loaded. Offline profiles without a tokenizer of
    their own use the word tokenizer the clients build from the run's data — the stand-in
    for a public tokenizer.
    """
    party = party or load_party_model(config)
    tokenizer = party.bundle.tokenizer or build_word_tokenizer(run_texts([*truth.train_all, *truth.test_all]))
    return AttackerKnowledge(
        model=party.model.eval(), tokenizer=tokenizer, preprocess_images=party.bundle.preprocess_images,
        cuts=config.cuts, instruction=party.instruction, device=party.device,
        recipe=TrainingRecipe(lr=config.train.lr, batch_size=config.train.batch_size,
                              steps=config.train.rounds * config.train.steps_per_round),
    )


def auxiliary_samples(config: SimConfig, truth: RunTruth, limit: int, seed: int = 1) -> list[VQASample]:
    """`limit` rows of the run's `threat.aux_split` whose images no client trains on or scores on."""
    data, split = config.data, config.threat.aux_split
    taken = {s.image_id for s in [*truth.train_all, *truth.test_all]}
    # Enough rows that `limit` remain after the clients' own rows of this split are left out.
    clients_rows = {data.train_split: truth.train_all, data.test_split: truth.test_all}.get(split, [])
    pool = load_vqa(data.dataset, split, data.source or None, limit=limit + len(clients_rows), seed=data.seed + seed)
    aux = [s for s in pool if s.image_id not in taken][:limit]
    if not aux:
        raise ValueError(f"no auxiliary rows left in {data.dataset}/{split} outside the clients' data")
    return aux


def replay(
    run_folder: str | Path,
    attack: str | Attack,
    *,
    options: Mapping[str, Any] | None = None,
    aux_limit: int | None = None,
    node_partitions: Mapping[int, int] | None = None,
    partition: int = 0,
    output: str | Path | None = None,
) -> AttackResult:
    """Fit `attack` on auxiliary data (`aux_limit` rows; None: the run's `threat.aux_limit`, the
    public data its server had), run it on the run's recording, score and save it.

    `attack` may also be an attack already fitted for another run of the same model and cuts
    (a sweep over pruning policies fits a passive attack once); it is then only run, and
    `options` and `aux_limit` do not apply."""
    folder = Path(run_folder).expanduser()
    recording = Recording.open(folder)
    if not recording.config:
        raise ValueError(f"{recording.folder} has no run config in its header: replay needs a run's recording")
    config = load_config(recording.config)
    truth = RunTruth.from_run_folder(folder, node_partitions)
    if isinstance(attack, Attack):
        instance = attack
        _check_fitted_for(instance, config)
        instance.prepare_replay(ReplayContext(folder, config, instance.knowledge, partition))
    else:
        instance = _fitted(attack, folder, config, truth, options, aux_limit, partition)
    result = instance.run(recording, truth)
    result.details["run"] = {"folder": str(folder), "paradigm": config.paradigm,
                             "pruning": config.pruning.policy, "profile": config.model.profile}
    result.save(Path(output) if output is not None else folder / ATTACK_FOLDER)
    return result


def fit_for_run(
    run_folder: str | Path, attack: str, *, options: Mapping[str, Any] | None = None, aux_limit: int | None = None
) -> Attack:
    """`attack` built with the run's settings and fitted on its public data, to replay on this
    run and on others of the same model and cuts (`replay(folder, attack_instance)`)."""
    folder = Path(run_folder).expanduser()
    config = load_config(json.loads((folder / "config.json").read_text())["config"])
    return _fitted(attack, folder, config, RunTruth.from_run_folder(folder), options, aux_limit, partition=0)


def _fitted(
    attack: str, folder: Path, config: SimConfig, truth: RunTruth, options: Mapping[str, Any] | None,
    aux_limit: int | None, partition: int,
) -> Attack:
    knowledge = knowledge_for_run(config, truth)
    instance = build_attack(attack, knowledge, **(attack_class(attack).options_from_run(config) | dict(options or {})))
    instance.prepare_replay(ReplayContext(folder, config, knowledge, partition))
    return instance.fit(auxiliary_samples(config, truth, config.threat.aux_limit if aux_limit is None else aux_limit))


def _check_fitted_for(attack: Attack, config: SimConfig) -> None:
    """A fitted attack carries its run's public model and cuts; another run must share them."""
    expected = (get_profile(config.model.profile).num_layers, tuple(config.cuts))
    found = (attack.knowledge.num_layers, tuple(attack.knowledge.cuts))
    if found != expected:
        raise ValueError(
            f"{attack.name} was fitted for a model of {found[0]} layers cut at {found[1]}; this run "
            f"({config.paradigm}, profile {config.model.profile!r}) has {expected[0]} layers cut at {expected[1]}"
        )
