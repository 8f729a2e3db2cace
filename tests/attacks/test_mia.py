"""Membership and attribute inference read what fine-tuning memorised — and nothing from a model that never saw the records."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from attacks import build_attack
from attacks.mia import MEAN_LOG_LIKELIHOOD, answer_confidences
from attacks.truth import StaticTruth
from vlm.segments import llava_parts

MEMBERS = 32
RECIPE = {"shadow_records": MEMBERS, "shadow_steps": 300, "shadow_lr": 3e-3, "batch_size": 8}


def trivial(metrics):
    """The better of the trivial attribute guesses: the most common answer, or a uniform pick."""
    return max(metrics["baseline_attribute_accuracy"], metrics["chance_attribute_accuracy"])


@pytest.fixture(scope="module")
def fitted(knowledge, victims, aux, tiny_model):
    """The attack fitted on two shadows, and a target fine-tuned on the members with the same recipe.

    The random tiny model's LM head is rescaled: at its initial scale (std 0.02) its logits
    cannot leave the uniform distribution, so no fine-tuning could memorise anything.
    """
    model = tiny_model()
    with torch.no_grad():
        llava_parts(model).lm_head.weight.mul_(10)
    public = dataclasses.replace(knowledge, model=model)
    attack = build_attack("mia", public, shadows=2, candidates=MEMBERS, attribute_records=MEMBERS, progress=False,
                          **RECIPE)
    target = attack.train_shadow(victims[:MEMBERS], seed=123)
    attack.fit(aux[: 2 * MEMBERS])
    truth = StaticTruth(members=victims[:MEMBERS], non_members=aux[-MEMBERS:])
    return attack, target, public.model, truth


def test_mia_tells_members_from_non_members_and_infers_their_answers(fitted):
    attack, target, _, truth = fitted
    metrics = attack.set_target(target).run(None, truth).metrics
    print(metrics)
    assert metrics["auc"] > 0.65
    assert metrics["attack_success"] > 0.6
    assert metrics["attribute_accuracy"] > trivial(metrics) + 0.2


def test_mia_learns_nothing_from_a_model_that_never_saw_the_records(fitted):
    attack, _, public, truth = fitted
    metrics = attack.set_target(public).run(None, truth).metrics
    print(metrics)
    assert metrics["attack_success"] < 0.6
    assert metrics["attribute_accuracy"] < trivial(metrics) + 0.15


def test_the_loss_attack_calibrated_by_the_public_model_reads_only_what_the_fine_tune_changed(fitted, knowledge):
    _, target, public_model, truth = fitted
    public = dataclasses.replace(knowledge, model=public_model)
    calibrated = build_attack("mia_loss", public, candidates=MEMBERS, attribute_records=0, reference="public",
                              progress=False).fit([])
    # The public model as its own target: every record's likelihood ratio is 1, its score 0.5.
    unchanged = calibrated.set_target(public_model).run(None, truth)
    assert torch.allclose(unchanged.outputs["scores"], torch.full_like(unchanged.outputs["scores"], 0.5))
    assert calibrated.set_target(target).run(None, truth).metrics["auc"] > 0.65


def test_an_unknown_reference_is_refused_naming_it(knowledge):
    with pytest.raises(ValueError, match="reference='shadow'"):
        build_attack("mia_loss", knowledge, reference="shadow", progress=False).fit([])


def test_records_fine_tuned_past_float32s_resolution_keep_their_order():
    # One answer token, its logit 30 and then 20 above the four others: losses of 4e-13 and 8e-9, both
    # below float32's resolution near 1, where exp(mean log-likelihood) would tie them at exactly 1.
    logits = torch.zeros(2, 2, 5)
    logits[0, 0, 3], logits[1, 0, 3] = 30.0, 20.0
    labels = torch.tensor([[-100, 3], [-100, 3]])
    rows = answer_confidences(logits, labels)
    likelihood = rows[:, MEAN_LOG_LIKELIHOOD].numpy()
    assert likelihood[1] < likelihood[0] < 0
    assert likelihood[0] == pytest.approx(-4 * math.exp(-30), rel=1e-3)
    assert np.exp(likelihood[1]) < np.exp(likelihood[0]) < 1.0
