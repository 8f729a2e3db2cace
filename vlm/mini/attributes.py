"""What each easy-VQA image shows, read off its own question-answer pairs.

The mini model's vision pretraining (a stand-in for CLIP's) needs image-level
shape and colour labels, and its base stage needs captions. easy-VQA ships no
such labels, but its answers imply them: "what color is the shape? blue", or
"does the image not contain a circle? no" (the shape is a circle). Only the
training split is read, so test labels never leak into training.
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass

from vqa import VQASample

SHAPES = ("circle", "rectangle", "triangle")
COLORS = ("red", "green", "blue", "yellow", "teal", "brown", "gray", "black")
# "is there not a ...", "does the image not contain ...", "is no ... present"
_NEGATION = re.compile(r"\bnot\b|^is no\b")


@dataclass(frozen=True)
class ImageAttributes:
    shape: str | None = None
    color: str | None = None

    def caption(self) -> str:
        """A short description in the words the questions use, e.g. "a blue circle"."""
        return " ".join(["a", *([self.color] if self.color else []), self.shape or "shape"])


def _attributes_asserted(sample: VQASample) -> ImageAttributes:
    answer = sample.answer
    if answer in SHAPES:
        return ImageAttributes(shape=answer)
    if answer in COLORS:
        return ImageAttributes(color=answer)
    negated = bool(_NEGATION.search(sample.question))
    if (answer == "yes") == negated:  # the question does not assert presence
        return ImageAttributes()
    words = re.findall(r"[a-z]+", sample.question.lower())
    return ImageAttributes(
        shape=next((w for w in words if w in SHAPES), None),
        color=next((w for w in words if w in COLORS), None),
    )


def image_attributes(samples: Iterable[VQASample]) -> dict[str, ImageAttributes]:
    """Shape and colour per image id, from every question that asserts one."""
    found: dict[str, ImageAttributes] = {}
    for sample in samples:
        asserted = _attributes_asserted(sample)
        known = found.get(sample.image_id, ImageAttributes())
        found[sample.image_id] = ImageAttributes(
            shape=known.shape or asserted.shape, color=known.color or asserted.color
        )
    return found
