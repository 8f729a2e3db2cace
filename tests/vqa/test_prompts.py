from __future__ import annotations

import pytest

from vqa.prompts import (
    IMAGE_PLACEHOLDER,
    build_follow_up_prompt,
    build_in_context_prompt,
    build_prompt,
    build_training_pair,
)


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


def test_a_follow_up_turn_has_no_image_and_the_same_question_body() -> None:
    assert build_follow_up_prompt("Is it red?", instruction=None) == "USER: Is it red? ASSISTANT:"
    assert build_follow_up_prompt("Why?", instruction="Explain.") == "USER: Why?\nExplain. ASSISTANT:"


@pytest.mark.parametrize("make_prompt", [build_prompt, build_follow_up_prompt])
def test_an_image_placeholder_in_the_question_is_refused(make_prompt) -> None:
    with pytest.raises(ValueError, match="image placeholder"):
        make_prompt(f"what is {IMAGE_PLACEHOLDER}?")


def test_an_in_context_prompt_shows_each_demonstration_with_its_own_image_then_the_question():
    prompt = build_in_context_prompt([("What shape?", " circle "), ("What color?", "red")], "Is it blue?", None,
                                     end_of_turn="</s>")
    assert prompt == (f"USER: {IMAGE_PLACEHOLDER}\nWhat shape? ASSISTANT: circle</s>"
                      f"USER: {IMAGE_PLACEHOLDER}\nWhat color? ASSISTANT: red</s>"
                      f"{build_prompt('Is it blue?', None)}")
    assert build_in_context_prompt([], "Is it blue?", end_of_turn="</s>") == build_prompt("Is it blue?")
