"""One command replays an attack against a run the Recorder recorded, scored against the run's own data."""

import json

import pytest
import torch

from attacks import MissingObservationError, Recorder, Recording
from attacks.cli import main
from attacks.knowledge import split_packed, visual_rows
from attacks.observations import fewer_visual_rows
from attacks.base import attack_class
from attacks.replay import knowledge_for_run, public_setting, replay
from attacks.truth import RunTruth
from clients.app import app as client_app
from sims.inprocess import InProcessGrid
from config import load_config
from strategies import app as server_app
from strategies.app import run
from vlm.features import VisionFeatureCache


def tiny_run(tmp_path, monkeypatch, **overrides):
    raw = {
        "paradigm": "usl", "model.profile": "tiny", "data.dataset": "easyvqa", "data.train_limit": 24,
        "data.test_limit": 6, "clients.count": 2, "train.rounds": 2, "train.steps_per_round": 2,
        "train.batch_size": 4, "train.lr": 1e-2, "eval.every": 0, "faults.timeout_s": 30.0,
        "output.root": str(tmp_path), "output.name": "run", **overrides,
    }
    monkeypatch.setattr(server_app, "OBSERVER_FACTORIES", [Recorder.factory()])
    return run(InProcessGrid(client_app, raw, 2), load_config(raw)).path


def test_actinv_replayed_on_a_recorded_usl_run_recovers_the_clients_questions(tmp_path, monkeypatch):
    folder = tiny_run(tmp_path, monkeypatch)
    recording = Recording.open(folder)
    # 2 rounds × 2 clients × 2 steps: each step's activation at CA and gradient at CB.
    assert len(recording.select("activation at CA")) == 8 and len(recording.select("gradient at CB")) == 8
    # Scored against the batches the run's seeded order gave each client and step: a wrong
    # step or partition would pair the recovered text with another question.
    result = replay(folder, "actinv", options={"iterations": 200, "max_transfers": 4, "progress": False},
                    aux_limit=16)
    print(result.metrics)
    assert result.metrics["exact_match"] == 1.0
    saved = json.loads((folder / "attacks" / "actinv.json").read_text())
    assert saved["metrics"] == pytest.approx(result.metrics)


def test_an_attack_replays_on_each_round_the_run_stored(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(server_app, "OBSERVER_FACTORIES", [])
    raw = {"paradigm": "usl", "model.profile": "tiny", "data.dataset": "easyvqa", "data.train_limit": 24,
           "data.test_limit": 6, "clients.count": 2, "train.rounds": 3, "train.steps_per_round": 2,
           "train.batch_size": 4, "eval.every": 0, "faults.timeout_s": 30.0, "output.root": str(tmp_path),
           "output.name": "run", "threat.model": "passive", "threat.record_rounds": "1,3", "threat.max_samples": 16}
    folder = run(InProcessGrid(client_app, raw, 2), load_config(raw)).path
    recording = Recording.open(folder)
    stored = recording.select("activation at CA")
    # Each listed round stores what fits its own cap of 16 samples (of 4 activations and 4 gradients); round 2 none.
    per_round = {r: sum(e.samples for e in stored if e.round == r) for r in (1, 2, 3)}
    assert per_round[1] == per_round[3] > 0 and per_round[2] == 0
    assert all(sum(e.samples for e in recording.entries if e.stored and e.round == r) <= 16 for r in (1, 3))
    options = {"iterations": 1, "progress": False}
    late = replay(folder, "actinv", options=options, aux_limit=8, round_=3)
    early = replay(folder, "actinv", options=options, aux_limit=8, round_=1)
    assert late.details["round"] == 3 and late.details["samples"] == per_round[3]
    assert (folder / "attacks" / "round-3" / "actinv.json").exists()
    # Scored against that round's own batches.
    assert late.details["true_questions"] != early.details["true_questions"]
    # Refused in one line, before anything is fitted: a round that stored nothing, an attack with no round.
    assert main(["run", str(folder), "actinv", "--round", "2"]) == 2
    assert "no transfer of round 2; rounds stored: [1, 3]" in capsys.readouterr().err
    assert main(["run", str(folder), "mia", "--round", "1"]) == 2
    assert "mia reads model, not a recorded transfer" in capsys.readouterr().err


def test_a_recording_without_what_the_attack_needs_is_refused_by_name(tmp_path, monkeypatch):
    folder = tiny_run(tmp_path, monkeypatch, **{"train.rounds": 1, "train.steps_per_round": 1})
    # The USL server's own rows at CB are not what it received: only a strategy that reports them records them.
    with pytest.raises(MissingObservationError, match="'activation at CB'.*direction 'down'"):
        main(["run", str(folder), "idlg", "--aux-limit", "8", "-o", "progress=false"])


@pytest.mark.parametrize("edge", [{}, {"privacy.defenses": "drop,shuffle", "privacy.drop.r": 4}], ids=["pruned", "edge"])
def test_the_truth_of_a_pruned_run_gives_the_patches_each_client_sent(edge, tmp_path, monkeypatch):
    """Under EDGE defenses the truth draws the step's drops and order again: the tiny tower drops
    after its only block's attention, so the sent rows are the kept patches' rows in the sent order."""
    folder = tiny_run(tmp_path, monkeypatch, **{"train.rounds": 1, "pruning.policy": "fixed", "pruning.ratio": 0.5,
                                                **edge})
    recording = Recording.open(folder)
    truth = RunTruth.from_run_folder(folder)
    knowledge = knowledge_for_run(truth.config)
    features = VisionFeatureCache(knowledge.model, knowledge.preprocess_images)
    prefix = knowledge.prefix_ids.numel()
    # A client's first step runs its untrained head: the public model's, so the truth's keep
    # sets must reproduce exactly the visual rows that crossed the cut.
    first_steps = [e for e in recording.select("activation at CA") if e.occurrence == 0]
    assert len(first_steps) == 2
    for entry in first_steps:
        samples = truth.samples(entry)
        keep = truth.keep_sets(entry)
        counts = [k.numel() for k in keep]
        # 16 tiny patches, ρ = 0.5; the edge drops 4 of the 16 before pruning's 8 are read.
        assert counts == [8] * len(samples) if not edge else all(4 <= c <= 8 for c in counts) and sum(counts) < 8 * len(samples)
        features.add(samples, progress=False)
        stacked = features.stack(samples)
        tensors = recording.tensors(entry)
        sent = [rows[prefix : prefix + c] for rows, c in zip(split_packed(tensors["rows"], tensors["lengths"]), counts, strict=True)]
        wrong = [k.sort().values if edge else torch.arange(8) for k in keep]
        for chosen, expected in ((keep, True), (wrong, False)):
            rebuilt = visual_rows(knowledge.model, stacked, knowledge.prefix_ids, knowledge.first_cut, chosen)
            same = all(torch.allclose(a, b.float(), atol=1e-5) for a, b in zip(rebuilt, sent, strict=True))
            assert same == expected


def test_a_plain_attack_is_fitted_once_across_defenses_an_adaptive_one_per_defense_setting():
    """What the sweep keys a fitted attack by: a plain attacker's fit does not depend on the run's
    defenses, an adaptive one's does."""
    plain = load_config({"output.name": "plain", "model.profile": "tiny", "privacy.defenses": ""})
    noisy = load_config({"output.name": "noisy", "model.profile": "tiny", "privacy.defenses": "noise",
                         "privacy.noise.variance": 0.1})
    assert public_setting(plain, defenses=False) == public_setting(noisy, defenses=False)
    assert public_setting(plain) != public_setting(noisy)
    for name in ("fora", "sara"):
        assert not attack_class(name).fit_adapts_to_defenses({})
        assert attack_class(name).fit_adapts_to_defenses({"adaptive": True})
    assert not attack_class("actinv").fit_adapts_to_defenses({"mask_zeros": True})


@pytest.mark.parametrize("config, fewer", [
    ({"pruning.policy": "off", "privacy.defenses": ""}, False),
    ({"pruning.policy": "off", "privacy.defenses": "shuffle,positionless"}, False),
    ({"pruning.policy": "off", "privacy.defenses": "noise,drop"}, True),
    ({"pruning.policy": "off", "privacy.defenses": "tome"}, True),
    ({"pruning.policy": "dtp", "privacy.defenses": ""}, True),
    ({}, True),
])
def test_the_server_counts_each_sample_s_visual_rows_when_pruning_or_the_edge_removes_tokens(config, fewer):
    """An unpruned run whose edge drops or merges tokens sends fewer than N visual rows: the attacks
    (and a hijacking server) must locate them as under pruning, not take the first N rows."""
    assert fewer_visual_rows(config) is fewer


@pytest.mark.parametrize(("argv", "says"), [
    (["fora", "-o", "decoder_steps=-5"], "fora: option decoder_steps=-5 is not allowed; allowed: a finite number >= 0"),
    (["actinv", "-o", "iterations=2.5"], "actinv: option iterations=2.5 is not allowed; allowed: an integer >= 0"),
    (["actinv", "-o", "lr=NaN"], "actinv: option lr=nan is not allowed"),
    (["actinv", "-o", "progress=1"], "actinv: option progress=1 is not allowed; allowed: true or false"),
    (["actinv", "-o", "nearest=3"], "actinv: option nearest=3 is not allowed; allowed: a string like its default 'l2'"),
    (["sara", "-o", "tpp_epoch=3"], "sara: unknown option 'tpp_epoch'; allowed: keep_ratios, shuffle"),
    (["sara", "-o", "keep_ratios=0.3,1.0"], "sara: option keep_ratios='0.3,1.0' is not allowed; allowed: a list of "
                                            "2 finite numbers >= 0, e.g. [0.3, 1.0]"),
    (["sara", "-o", "mae_mask_ratios=[0.1]"], "sara: option mae_mask_ratios=[0.1] is not allowed"),
    (["mia"], "no run folder at"),
    (["mia", "--here"], "neither a recording"),
], ids=["negative", "fraction", "nan", "bool", "string", "unknown", "pair-as-text", "pair-too-short", "no-folder",
        "no-recording"])
def test_the_attack_cli_refuses_in_one_line_before_it_fits_anything(argv, says, tmp_path, capsys):
    folder = tmp_path if "--here" in argv else tmp_path / "absent"
    attack, *options = [a for a in argv if a != "--here"]
    assert main(["run", str(folder), attack, *options]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
