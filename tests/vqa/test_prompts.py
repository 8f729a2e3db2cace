from __future__ import annotations

import pytest

from vqa.prompts import IMAGE_PLACEHOLDER, build_prompt, build_training_pair


def test_llava_short_answer_prompt_is_exact() -> None:
    assert build_prompt("What organ is shown?") == (
        "USER: <image>\nWhat organ is shown?\nAnswer the question using a single word or phrase. ASSISTANT:"
    )


def test_instruction_is_a_parameter_and_can_be_left_out() -> None:
    assert build_prompt(" Why? ", instruction="Explain.") == "USER: <image>\nWhy?\nExplain. ASSISTANT:"
    assert build_prompt("Why?", instruction=None) == "USER: <image>\nWhy? ASSISTANT:"


def test_training_pair_puts_the_answer_after_the_prompt() -> None:
    pair = build_training_pair("Is it red?", " yes ")
    assert pair.completion == " yes"
    assert pair.text == build_prompt("Is it red?") + " yes"
    assert pair.prompt.count(IMAGE_PLACEHOLDER) == 1


def test_a_second_image_placeholder_in_the_question_is_refused() -> None:
    with pytest.raises(ValueError, match="image placeholder"):
        build_prompt(f"what is {IMAGE_PLACEHOLDER}?")
