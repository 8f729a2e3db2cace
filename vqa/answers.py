"""Answer text conventions shared by the adapters and the scorer.

Two levels, on purpose: ``canonical_answer`` is the light clean-up applied when a
sample is loaded (it stays a readable training target), ``normalize_answer`` is the
aggressive VQA-evaluation normalisation applied only when comparing answers.
"""

from __future__ import annotations

import re
import unicodedata

YES_NO_ANSWERS = frozenset({"yes", "no"})

_WHITESPACE = re.compile(r"\s+")
# Commas inside numbers ("1,000") and periods inside decimals ("3.5") are part of the
# number, as in the official VQA evaluation; every other punctuation mark separates words.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d)")
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")
_DECIMAL_MARK = "\uE000"
_APOSTROPHES = re.compile(r"['’`]")
_ARTICLES = frozenset({"a", "an", "the"})
# The VQA evaluation's number-word map (it maps "none" to "0" as well).
_NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}


def canonical_answer(raw: object) -> str:
    """Lower-cased, whitespace-collapsed answer text ("" when there is none)."""
    if raw is None:
        return ""
    return _WHITESPACE.sub(" ", str(raw)).strip().lower()


def is_yes_no(answer: str) -> bool:
    return canonical_answer(answer) in YES_NO_ANSWERS


def normalize_answer(text: str) -> str:
    """VQA-evaluation style normalisation used before any answer comparison.

    Lower-case; drop apostrophes ("it's" -> "its"); keep thousands commas and decimal
    points inside numbers ("1,000" -> "1000", "3.5" stays); turn all other
    punctuation into spaces; map number words to digits; drop articles.
    """
    lowered = unicodedata.normalize("NFKC", text).lower()
    lowered = _APOSTROPHES.sub("", lowered)
    lowered = _THOUSANDS_COMMA.sub("", lowered)
    lowered = _DECIMAL_POINT.sub(_DECIMAL_MARK, lowered)
    spaced = "".join(
        " " if unicodedata.category(char).startswith(("P", "S")) else char for char in lowered
    ).replace(_DECIMAL_MARK, ".")
    words = [_NUMBER_WORDS.get(word, word) for word in spaced.split()]
    return " ".join(word for word in words if word not in _ARTICLES)
