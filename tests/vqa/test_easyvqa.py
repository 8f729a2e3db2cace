"""The bundled, offline default dataset as shipped by the easy-vqa package."""

from __future__ import annotations

from collections import Counter

import easy_vqa
import pytest

from vqa import VQADataset, load_vqa
from vqa.adapters.easyvqa import QUESTION_KINDS, SHAPE_ANSWERS


@pytest.fixture(scope="module")
def test_split() -> VQADataset:
    return load_vqa("easyvqa", "test")


@pytest.mark.parametrize(("split", "questions", "images"), [("train", 38_575, 4_000), ("test", 9_673, 1_000)])
def test_splits_as_shipped(split: str, questions: int, images: int) -> None:
    samples = load_vqa("easyvqa", split)
    assert len(samples) == questions
    assert len({sample.image_id for sample in samples}) == images
    assert len({sample.id for sample in samples}) == questions


def test_answers_come_from_the_package_vocabulary_and_are_all_closed(test_split: VQADataset) -> None:
    assert {sample.answer for sample in test_split} <= set(easy_vqa.get_answers())
    assert {sample.answer_type for sample in test_split} == {"closed"}


def test_question_kind_follows_the_answer(test_split: VQADataset) -> None:
    kinds = Counter(sample.question_kind for sample in test_split)
    assert set(kinds) == set(QUESTION_KINDS)
    for sample in test_split:
        if sample.question_kind == "yes/no":
            assert sample.answer in {"yes", "no"}
        elif sample.question_kind == "shape":
            assert sample.answer in SHAPE_ANSWERS and "shape" not in sample.question.split()[-1:]
        else:
            assert sample.answer not in SHAPE_ANSWERS | {"yes", "no"}


def test_first_sample_matches_the_package_and_decodes(test_split: VQADataset) -> None:
    texts, answers, image_ids = easy_vqa.get_test_questions()
    first = test_split[0]
    assert (first.question, first.answer, first.image_id) == (texts[0], answers[0], f"test/{image_ids[0]}")
    image = first.image
    assert image.mode == "RGB" and image.size == (64, 64)


def test_questions_about_one_image_share_its_id(test_split: VQADataset) -> None:
    per_image = Counter(sample.image_id for sample in test_split)
    assert max(per_image.values()) > 1


def test_image_ids_are_unique_across_splits():
    """The package numbers each split's images from 0; a shared id would make caches
    keyed by image id hand test questions a training image."""
    train_ids = {sample.image_id for sample in load_vqa("easyvqa", "train")}
    test_ids = {sample.image_id for sample in load_vqa("easyvqa", "test")}
    assert not train_ids & test_ids
