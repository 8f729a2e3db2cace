from __future__ import annotations

from types import SimpleNamespace

import pytest
from PIL import Image

from vqa.answers import normalize_answer
from vqa.images import InMemoryImage
from vqa.schema import VQASample
from vqa.scoring import (
    aggregate_accuracy,
    exact_match,
    first_token_substring_match,
    question_only_predictions,
    score_sample,
    token_recall,
    vqa_soft_accuracy,
)


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("  The Dog. ", "dog"),
        ("Two", "2"),
        ("none", "0"),
        ("1,000", "1000"),
        ("3.5 cm", "3.5 cm"),
        ("black-and-white", "black and white"),
        ("it's a cat!", "its cat"),
        ("Yes, there is.", "yes there is"),
        ("left\tlung", "left lung"),
    ],
)
def test_normalize_answer(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


def test_exact_match_after_normalisation_only() -> None:
    assert exact_match("Yes.", "yes") == 1.0
    assert exact_match("two", "2") == 1.0
    assert exact_match("yes there is", "yes") == 0.0


def test_token_recall_is_share_of_gold_tokens_found() -> None:
    assert token_recall("the left lung", "left lung") == 1.0
    assert token_recall("lung", "left lung") == 0.5
    assert token_recall("right kidney", "left lung") == 0.0
    assert token_recall("lung lung", "lung lung") == 1.0
    assert token_recall("lung", "lung lung") == 0.5
    assert token_recall("the", "the") == 1.0


def test_first_token_substring_match_definition() -> None:
    assert first_token_substring_match("left", "left lung")
    assert first_token_substring_match("lung cancer", "left lung")
    assert not first_token_substring_match("cancer lung", "left lung")
    assert first_token_substring_match("The liver", "liver")  # articles are dropped first
    assert first_token_substring_match("no", "nodule")  # character substring, as specified
    assert not first_token_substring_match("", "yes")
    assert first_token_substring_match("two", ["3", "2"])


def test_vqa_soft_accuracy_counts_humans_up_to_three() -> None:
    humans = ["2"] * 2 + ["two"] + ["3"] * 4 + ["4"] * 3
    assert vqa_soft_accuracy("2", humans) == 1.0
    assert vqa_soft_accuracy("4", humans) == 1.0
    assert vqa_soft_accuracy("5", humans) == 0.0
    assert vqa_soft_accuracy("blue", ["blue", "navy", "navy"]) == pytest.approx(1 / 3)
    assert vqa_soft_accuracy("navy", ["blue", "navy", "navy"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        vqa_soft_accuracy("x", [])


def _sample(answer: str, answer_type: str, kind: str, answers: tuple[str, ...] = ()) -> VQASample:
    return VQASample(
        id=answer,
        dataset="synthetic",
        split="test",
        question="q?",
        answer=answer,
        answer_type=answer_type,  # type: ignore[arg-type]
        question_kind=kind,
        image_id="0",
        source_row=0,
        answers=answers,
        image_ref=InMemoryImage(Image.new("RGB", (1, 1))),
    )


def test_score_sample_picks_the_metric_of_the_sample() -> None:
    assert score_sample("lung", _sample("left lung", "open", "organ")) == 0.5
    assert score_sample("left", _sample("left lung", "closed", "organ")) == 0.0
    assert score_sample("navy", _sample("navy", "open", "other", ("navy", "blue", "blue"))) == pytest.approx(1 / 3)


def test_aggregate_reports_overall_per_type_and_per_kind() -> None:
    samples = [
        _sample("yes", "closed", "yes/no"),
        _sample("no", "closed", "yes/no"),
        _sample("left lung", "open", "organ"),
        _sample("liver", "open", "organ"),
    ]
    report = aggregate_accuracy(["yes", "yes", "lung", "liver"], samples)
    assert report.overall.accuracy == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert report.overall.count == 4
    assert report.by_answer_type["closed"].accuracy == 0.5
    assert report.by_answer_type["open"].accuracy == 0.75
    assert report.by_question_kind["organ"].count == 2
    with pytest.raises(ValueError, match="3 predictions for 4 samples"):
        aggregate_accuracy(["yes"] * 3, samples)


def row(question: str, answer: str, kind: str) -> SimpleNamespace:
    return SimpleNamespace(question=question, answer=answer, question_kind=kind)


def test_the_question_only_baseline_answers_each_text_with_its_commonest_training_answer():
    train = [
        row("Is there a red circle?", "no", "exist"),
        row("Is there a red circle?", "yes", "exist"),
        row("Is there a red circle?", "no", "exist"),
        row("How many circles are there?", "2", "count"),
        row("How many squares are there?", "1", "count"),
        row("How many squares are there?", "1", "count"),
        row("What shape is left of the red circle?", "unanswerable", "unanswerable"),
    ]
    test = [
        row("Is there a red circle?", "yes", "exist"),
        row("How many circles are there?", "1", "count"),
        # Never seen in training: the commonest answer of its kind ("1": two rows against one).
        row("How many triangles are there?", "1", "count"),
        # Seen under another kind: the text decides, not the kind.
        row("What shape is left of the red circle?", "square", "relation"),
    ]
    predictions, fallbacks = question_only_predictions(train, test)
    assert predictions == ["no", "2", "1", "unanswerable"]
    assert fallbacks == 1


def test_a_tie_goes_to_the_answer_seen_first():
    train = [row("q", "b", "k"), row("q", "a", "k"), row("q", "a", "k"), row("q", "b", "k")]
    assert question_only_predictions(train, [row("q", "a", "k")]) == (["b"], 0)
