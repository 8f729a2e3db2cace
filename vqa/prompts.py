"""LLaVA-1.5 conversation prompts for VQA."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The one spelling of the image placeholder; the processor expands it into patch tokens.
IMAGE_PLACEHOLDER = "<image>"
# LLaVA-1.5's instruction for short-answer VQA benchmarks (VQAv2, GQA, OK-VQA, ...).
SHORT_ANSWER_INSTRUCTION = "Answer the question using a single word or phrase."


@dataclass(frozen=True)
class PromptPair:
    """Prompt and completion of one training example; the loss covers only ``completion``.

    The end-of-sequence token is left to the tokenizer, which knows its spelling.
    """

    prompt: str
    completion: str

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def build_prompt(question: str, instruction: str | None = SHORT_ANSWER_INSTRUCTION) -> str:
    """``USER: <image>\\n{question}\\n{instruction} ASSISTANT:`` (no instruction line when None)."""
    return f"USER: {IMAGE_PLACEHOLDER}\n{_question_body(question, instruction)} ASSISTANT:"


def build_follow_up_prompt(question: str, instruction: str | None = SHORT_ANSWER_INSTRUCTION) -> str:
    """A later turn of the same conversation, ``USER: {question}\\n{instruction} ASSISTANT:``:
    LLaVA-1.5 shows the image once, in the first turn, and trains on multi-turn conversations."""
    return f"USER: {_question_body(question, instruction)} ASSISTANT:"


def build_in_context_prompt(
    demonstrations: Sequence[tuple[str, str]],
    question: str,
    instruction: str | None = SHORT_ANSWER_INSTRUCTION,
    *,
    end_of_turn: str,
) -> str:
    """In-context demonstrations, then the question: one LLaVA-1.5 multi-image conversation in
    which every turn shows its own image, ``USER: <image>\\n{q_1} ASSISTANT: {a_1}{end_of_turn}...
    USER: <image>\\n{question} ASSISTANT:``. `end_of_turn` is the tokenizer's end-of-sequence
    token, which closes each assistant turn in LLaVA-1.5's conversations."""
    turns = [f"{build_prompt(q, instruction)} {a.strip()}{end_of_turn}" for q, a in demonstrations]
    return "".join(turns) + build_prompt(question, instruction)


def _question_body(question: str, instruction: str | None) -> str:
    if IMAGE_PLACEHOLDER in question:
        raise ValueError(
            f"question must not contain the image placeholder {IMAGE_PLACEHOLDER!r}: {question!r}"
        )
    return question.strip() if instruction is None else f"{question.strip()}\n{instruction}"


def build_training_pair(
    question: str, answer: str, instruction: str | None = SHORT_ANSWER_INSTRUCTION
) -> PromptPair:
    return PromptPair(build_prompt(question, instruction), f" {answer.strip()}")
