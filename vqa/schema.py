"""The one sample shape every adapter produces and every consumer reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

from PIL import Image

from vqa.errors import RowProblem, VQADataError
from vqa.images import ImageRef, open_row_image

AnswerType = Literal["closed", "open"]
ANSWER_TYPES: tuple[AnswerType, ...] = ("closed", "open")


@dataclass(frozen=True)
class VQASample:
    """One question about one image.

    ``answer`` is the canonical answer (lower-cased); ``answers`` keeps every human
    answer where the source has several (VQAv2, OK-VQA: ten each) because their soft
    accuracy scores against all of them; it is empty otherwise. ``image_id`` is shared
    by all questions about the same image, so images are cached and partitioned once
    per image. ``source_row`` is the row's index in the source split, for messages.
    ``needed_boxes`` are the pixel boxes (left, top, right, bottom; right and bottom
    exclusive) of what the question needs, where a generated benchmark knows them
    (``vqa.scenes``); empty otherwise.
    """

    id: str
    dataset: str
    split: str
    question: str
    answer: str
    answer_type: AnswerType
    question_kind: str
    image_id: str
    source_row: int
    answers: tuple[str, ...] = ()
    needed_boxes: tuple[tuple[int, int, int, int], ...] = ()
    image_ref: ImageRef = field(repr=False, compare=False, kw_only=True)

    @property
    def image(self) -> Image.Image:
        """The decoded RGB image; a failure names this sample's dataset, split and row."""
        return open_row_image(
            self.image_ref, dataset=self.dataset, split=self.split, row=self.source_row, item_id=self.id
        )


class VQADataset(Sequence[VQASample]):
    """The samples of one dataset split, in source order."""

    def __init__(self, name: str, split: str, samples: Iterable[VQASample]) -> None:
        self.name = name
        self.split = split
        self._samples = tuple(samples)

    def __len__(self) -> int:
        return len(self._samples)

    @overload
    def __getitem__(self, index: int) -> VQASample: ...

    @overload
    def __getitem__(self, index: slice) -> VQADataset: ...

    def __getitem__(self, index: int | slice) -> VQASample | VQADataset:
        if isinstance(index, slice):
            return VQADataset(self.name, self.split, self._samples[index])
        return self._samples[index]

    def __iter__(self) -> Iterator[VQASample]:
        return iter(self._samples)

    def __repr__(self) -> str:
        return f"VQADataset(name={self.name!r}, split={self.split!r}, samples={len(self)})"

    def select(self, indices: Sequence[int]) -> VQADataset:
        return VQADataset(self.name, self.split, (self._samples[i] for i in indices))

    def verify_images(self) -> None:
        """Decode each distinct image once now, reporting all unreadable ones in one error."""
        problems: list[RowProblem] = []
        first_sample_per_image = {sample.image_id: sample for sample in reversed(self._samples)}
        for sample in first_sample_per_image.values():
            try:
                sample.image_ref.open()
            except Exception as err:  # collected so one run reports every bad image
                problem = f"unreadable image ({sample.image_ref.describe()}): {err}"
                problems.append(RowProblem(sample.source_row, sample.id, problem))
        if problems:
            raise VQADataError.for_rows(self.name, self.split, problems)
