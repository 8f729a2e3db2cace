"""The cut probe reads the stamped digit from the rows at the cut, and only when they show the digit's image."""

from pathlib import Path

import pytest
import torch

from attacks import build_attack
from attacks.knowledge import AttackerKnowledge
from attacks.recording import Recorder, Recording
from attacks.truth import StaticTruth
from config import load_config
from pruning import build_policy, get_policy, policy_options
from pruning.policies import PolicyContext
from vlm.loading import clip_image_preprocessor
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import TINY
from vqa import load_vqa, mark_records


@pytest.fixture(scope="module")
def stamped():
    """Victims from the stamped training split, the attacker's auxiliary images from the stamped
    test split (handwriting disjoint), and the victims' marks for the truth."""
    victims = list(load_vqa("easyvqa-stamped", "train", limit=96, seed=0))
    aux = list(load_vqa("easyvqa-stamped", "test", limit=400, seed=1))
    return victims, aux, mark_records("easyvqa-stamped", "train")


@pytest.fixture(scope="module")
def knowledge(stamped, tiny_model):
    victims, aux, _ = stamped
    return AttackerKnowledge(model=tiny_model(), tokenizer=build_sample_tokenizer([*victims, *aux]),
                             preprocess_images=clip_image_preprocessor(TINY.image_size), cuts=TINY.usl_cuts,
                             instruction="")


def record(tmp_path: Path, knowledge, victims, marks, client_activation, defense=None) -> tuple[Recording, StaticTruth]:
    recorder = Recorder(tmp_path / "recording", header={"config": {"paradigm": "usl", "pruning.policy": "off"}})
    by_seq = {}
    for start in range(0, len(victims), 16):
        batch = victims[start : start + 16]
        tensors = client_activation(knowledge, knowledge.model, batch)
        entry = recorder.record(1, 1, "activation at CA", tensors if defense is None else defense(tensors))
        by_seq[entry.seq] = batch
    return Recording.open(tmp_path / "recording"), StaticTruth(by_seq, {}, marks_by_image=marks)


@pytest.mark.parametrize("readout", ["rows", "pooled"])
def test_the_probe_reads_the_digit_from_rows_that_show_it(tmp_path, knowledge, stamped, client_activation, readout):
    victims, aux, marks = stamped
    recording, truth = record(tmp_path, knowledge, victims, marks, client_activation)
    result = build_attack("cut_probe", knowledge, readout=readout, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["marked_samples"] >= 30
    # A random tiny model still carries the stamped image to the cut; guessing reads under 20%.
    assert result.metrics["mark_readback"] > result.metrics["mark_readback_chance"] + 0.15
    assert result.outputs["predicted_digits"].shape == (len(victims),)


def test_the_probe_reads_no_more_than_a_guess_from_another_images_rows(tmp_path, knowledge, stamped,
                                                                        client_activation, swap_images_within_batch):
    victims, aux, marks = stamped
    recording, truth = record(tmp_path, knowledge, victims, marks, client_activation,
                              defense=swap_images_within_batch(knowledge))
    result = build_attack("cut_probe", knowledge, progress=False).fit(aux).run(recording, truth)
    print(result.metrics)
    assert result.metrics["mark_readback"] < result.metrics["mark_readback_chance"] + 0.05


def test_with_no_row_of_a_mark_to_learn_from_the_probe_guesses_the_commonest_digit(tmp_path, knowledge, stamped,
                                                                                   client_activation):
    victims, aux, marks = stamped
    recording, truth = record(tmp_path, knowledge, victims, marks, client_activation)
    probe = build_attack("cut_probe", knowledge, progress=False).fit(aux)
    # As when the policy prunes every mark's box from the attacker's own images.
    probe.aux_boxes = [set() for _ in probe.aux_boxes]
    result = probe.run(recording, truth)
    predicted = set(result.outputs["predicted_digits"].tolist())
    assert len(predicted) == 1 and probe.aux_digits.tolist().count(predicted.pop()) == max(
        probe.aux_digits.tolist().count(d) for d in set(probe.aux_digits.tolist()))
    assert "guesses the commonest digit" in result.details["aux_keep_sets"]


def test_an_unknown_readout_is_refused_naming_it(knowledge, stamped):
    with pytest.raises(ValueError, match="readout='mean'"):
        build_attack("cut_probe", knowledge, readout="mean", progress=False).fit(stamped[1])


def test_the_attacker_prunes_its_images_as_the_runs_policy_would(knowledge, stamped):
    _, aux, _ = stamped
    attack = build_attack("cut_probe", knowledge, progress=False, batch_size=32).fit(aux)
    attack.run_config = load_config({"output.name": "probe", "model.profile": "tiny", "pruning.policy": "random",
                                     "pruning.ratio": 0.75, "pruning.seed": 3})
    keep, features, source = attack._aux_keep([10])
    options = policy_options(get_policy("random"), {"ratio": 0.75})
    expected = build_policy("random", PolicyContext(profile="tiny", options=options, seed=3))(
        attack.aux_features, attack.aux).keep
    assert source == "the run's policy (random)" and torch.equal(features, attack.aux_features)
    assert all(torch.equal(a, b) for a, b in zip(keep, expected, strict=True))
    # Without the run's config: random keep sets of the observed sizes.
    attack.run_config = None
    keep, _, source = attack._aux_keep([3, 5])
    assert source == "random, of the observed sizes" and {len(k) for k in keep} == {3, 5}


def test_an_attacker_that_knows_a_merging_policy_reads_its_merged_rows(knowledge, stamped):
    _, aux, _ = stamped
    attack = build_attack("cut_probe", knowledge, progress=False, batch_size=32).fit(aux)
    attack.run_config = load_config({"output.name": "probe", "model.profile": "tiny", "pruning.policy": "visionzip",
                                     "pruning.ratio": 0.75})
    keep, features, _ = attack._aux_keep([10])
    options = policy_options(get_policy("visionzip"), {"ratio": 0.75})
    selection = build_policy("visionzip", PolicyContext(profile="tiny", options=options, model=knowledge.model,
                                                        pixel_values=knowledge.pixel_values))(attack.aux_features, attack.aux)
    sent = selection.rows(attack.aux_features)
    assert all(torch.allclose(features[i, indices], rows) for i, (indices, rows) in enumerate(zip(keep, sent, strict=True)))
    assert not torch.allclose(features, attack.aux_features)


def test_auxiliary_images_without_marks_are_refused(knowledge):
    plain = list(load_vqa("easyvqa", "test", limit=20, seed=1))
    with pytest.raises(ValueError, match="0 of the 20 auxiliary samples carry a mark"):
        build_attack("cut_probe", knowledge, progress=False).fit(plain)
