"""benchmarks/qpriv_evaluation.py on the tiny random-weight model and a few test questions: the
irrelevant-question probes' truths, equal budgets across policies, Chefer relevance over the sent
rows, the deletion curves and the report rendered from what was measured."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import qpriv_evaluation as qe  # noqa: E402
import testbed  # noqa: E402

from pruning import keep_count  # noqa: E402
from vlm.segments import llava_parts  # noqa: E402
from vqa.adapters.scenes import split_scenes  # noqa: E402
from vqa.scenes import REFUSAL_ANSWER, answer_in_scene  # noqa: E402


@pytest.fixture(scope="module")
def evaluation():
    torch.manual_seed(0)
    args = argparse.Namespace(profile="tiny", questions=24, seed=0, no_progress=True, probe_images=20)
    return qe.Evaluation(testbed.Testbed(args), folders=[])


RUNS = [qe.PolicyRun("off", "off", "off"), qe.PolicyRun("random @25%", "random", "random", {"ratio": qe.QUARTER}),
        qe.PolicyRun("visionzip @25%", "visionzip", "visionzip", {"ratio": qe.QUARTER})]


def test_the_irrelevant_probes_are_scored_by_what_the_image_answers(evaluation):
    bed = evaluation.bed
    probes = qe.irrelevant_probes(bed, seed=0)
    scenes = {scene.image_id: scene for scene in split_scenes(bed.spec, "test")}
    assert probes["cross_image"] and probes["nonsense"] and probes["false_premise"]
    for sample in probes["cross_image"]:
        scene = scenes[sample.image_id]
        assert sample.question not in {q.question for q in scene.questions}
        assert sample.answer == answer_in_scene(scene, sample.question)
    assert all(answer_in_scene(scenes[s.image_id], s.question) is None for s in probes["nonsense"])
    assert all(answer_in_scene(scenes[s.image_id], s.question) == REFUSAL_ANSWER for s in probes["false_premise"])
    assert qe.irrelevant_probes(bed, seed=0) == probes


def test_policies_keep_equal_tokens_and_merged_patches_count_as_sent(evaluation):
    saved = []
    result = qe.measure_policies(evaluation, RUNS, 0.2, {}, saved.append)
    bed = evaluation.bed
    budget = keep_count(qe.QUARTER, bed.num_patches, bed.profile.k_min)
    rows = result["per_question"]
    assert set(rows["random @25%"]["kept"]) == set(rows["visionzip @25%"]["kept"]) == {budget}
    off = result["policies"]["off"]
    assert off["kept_share"] == 1.0 and off["mark_sent_share"]["value"] == 1.0
    random_sent = result["policies"]["random @25%"]["mark_sent_share"]["value"]
    assert random_sent < 1.0
    # VisionZip merges every patch it does not keep into a sent row: all of the digit is sent.
    assert result["policies"]["visionzip @25%"]["mark_sent_share"]["value"] == 1.0
    assert 0 <= result["policies"]["random @25%"]["digit_probe"]["value"] <= 1
    assert len(saved) == len(RUNS) and result["privacy_subset"]["images"] == result["privacy_subset"]["of_images"]
    # A resumed part measures only the policies it lacks.
    again = qe.measure_policies(evaluation, RUNS, 0.2, saved[-1], lambda state: pytest.fail("measured again"))
    assert again["policies"].keys() == result["policies"].keys()


def test_chefer_relevance_scores_every_sent_row(evaluation):
    bed = evaluation.bed
    sample = bed.test[0]
    bed.features.add([sample], progress=False)
    rows = bed.features[sample.image_id][:5]
    language = llava_parts(bed.bundle.model).language_model
    implementation = language.config._attn_implementation
    relevance = qe.chefer_relevance(evaluation, sample, rows)
    assert relevance.shape == (5,) and torch.isfinite(relevance).all() and (relevance >= 0).all()
    assert language.config._attn_implementation == implementation


def test_deletion_curves_and_the_report(evaluation, tmp_path):
    deletion = qe.measure_deletion(evaluation, RUNS[:2], questions=4)
    for curves in deletion["policies"].values():
        # Nothing deleted: both orders answer as the policy does.
        assert curves["relevant_first"][0]["value"] == curves["random"][0]["value"]
        assert len(curves["random"]) == 1 + len(qe.DELETION_SHARES)
    irrelevant = qe.measure_irrelevant(evaluation, RUNS[:2])
    assert {"refusal", "hallucination"} <= set(irrelevant["policies"]["off"]["nonsense"])
    policies = qe.measure_policies(evaluation, RUNS[:2], 0.2, {}, lambda state: None)
    results = {"key": {"seed": 0}, "budgets": {"dtp_mean_kept": 16.0, "num_patches": 64, "dtp_ratio": 0.75},
               "parts": {"policies": {"result": policies}, "irrelevant": {"result": irrelevant},
                         "deletion": {"result": deletion}}}
    text = qe.render_report(results, tmp_path).read_text()
    assert "random @25%" in text and "Irrelevant questions" in text and "most relevant first" in text
