import pytest

from vlm.mini.attributes import ImageAttributes, image_attributes
from vqa import load_vqa
from vqa.images import FileImage
from vqa.schema import VQASample


def sample(question: str, answer: str, image_id: str = "7") -> VQASample:
    return VQASample(
        id=f"{image_id}:{question}", dataset="easyvqa", split="train", question=question, answer=answer,
        answer_type="closed", question_kind="yes/no", image_id=image_id, source_row=0,
        image_ref=FileImage("unused.png"),
    )


@pytest.mark.parametrize(
    ("question", "answer", "expected"),
    [
        ("what color is the shape?", "blue", ImageAttributes(color="blue")),
        ("what shape is in the image?", "circle", ImageAttributes(shape="circle")),
        ("is there a red shape?", "yes", ImageAttributes(color="red")),
        ("is there a red shape?", "no", ImageAttributes()),
        ("does the image not contain a triangle?", "no", ImageAttributes(shape="triangle")),
        ("does the image not contain a triangle?", "yes", ImageAttributes()),
        ("is no gray rectangle present?", "no", ImageAttributes(shape="rectangle", color="gray")),
    ],
)
def test_attributes_follow_from_answers_and_negation(question, answer, expected):
    assert image_attributes([sample(question, answer)]) == {"7": expected}


def test_attributes_accumulate_across_questions_on_one_image():
    found = image_attributes([sample("what color is the shape?", "teal"), sample("is there a circle?", "yes")])
    assert found["7"] == ImageAttributes(shape="circle", color="teal")
    assert found["7"].caption() == "a teal circle"


def test_derived_labels_agree_with_every_shape_and_color_answer_in_easy_vqa():
    train = load_vqa("easyvqa", "train")
    found = image_attributes(train)
    for s in train:
        if s.question_kind == "shape":
            assert found[s.image_id].shape == s.answer, s
        elif s.question_kind == "color":
            assert found[s.image_id].color == s.answer, s
    assert sum(a.shape is not None for a in found.values()) > 0.85 * len(found)
