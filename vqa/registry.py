"""Dataset adapters behind a registry, and the one loading path they all share.

An adapter only knows its source's layout: it opens a split and turns rows into
``SourceRow``s. Validation, sub-sampling and error reporting live here, once, so every
dataset fails the same way and cheap checks always run before images are touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vqa.errors import RowProblem, VQADataError
from vqa.images import ImageRef
from vqa.prompts import IMAGE_PLACEHOLDER
from vqa.schema import ANSWER_TYPES, AnswerType, VQADataset, VQASample


@dataclass
class SourceRow:
    """A row as read from the source, before validation.

    ``read_rows`` fills the text fields and ``image_key`` (the source's image name or
    id, "" when it has none); ``attach_images`` then sets ``image_id`` and
    ``image_ref``, or leaves ``image_ref`` None and says in ``missing_image_reason``
    what was looked for.
    """

    row_index: int
    id: str
    question: str
    answer: str
    answer_type: AnswerType
    question_kind: str
    image_key: str = ""
    answers: tuple[str, ...] = ()
    needed_boxes: tuple[tuple[int, int, int, int], ...] = ()
    image_id: str = ""
    image_ref: ImageRef | None = None
    missing_image_reason: str = ""


class SourceTable(Protocol):
    """One opened split, read in two passes so text checks never wait on images."""

    @property
    def num_rows(self) -> int: ...

    def read_rows(self, indices: Sequence[int]) -> list[SourceRow]:
        """The text of the rows at ``indices`` (only selected rows cost)."""
        ...

    def attach_images(self, rows: list[SourceRow]) -> None:
        """Resolve each row's image reference and ``image_id``, without decoding."""
        ...


class DatasetAdapter(Protocol):
    name: str
    splits: tuple[str, ...]
    default_source: str | None

    def open(self, source: str | None, split: str) -> SourceTable:
        """Open ``split`` of ``source`` (the adapter's default when None)."""
        ...


_ADAPTERS: dict[str, DatasetAdapter] = {}


def register_dataset(adapter: DatasetAdapter, *, replace: bool = False) -> DatasetAdapter:
    if adapter.name in _ADAPTERS and not replace:
        raise ValueError(
            f"dataset {adapter.name!r} is already registered; pass replace=True to override it"
        )
    _ADAPTERS[adapter.name] = adapter
    return adapter


def dataset_names() -> tuple[str, ...]:
    return tuple(sorted(_ADAPTERS))


def get_adapter(name: str) -> DatasetAdapter:
    try:
        return _ADAPTERS[name]
    except KeyError:
        known = ", ".join(dataset_names())
        raise VQADataError(f"unknown dataset {name!r}; known datasets: {known}", dataset=name) from None


def is_stamped(dataset: str) -> bool:
    """Whether `dataset` is a stamped benchmark: its adapter records a mark per stamped image
    (a ``marks(source, split)`` method)."""
    return callable(getattr(get_adapter(dataset), "marks", None))


def mark_records(dataset: str, split: str, source: str | None = None) -> dict:
    """The mark (``vqa.MarkRecord``) of every stamped image of ``split`` of a stamped dataset, by
    image id. Covers the whole split whatever ``load_vqa``'s ``limit`` kept; a sample's mark is
    ``mark_records(...).get(sample.image_id)`` (None: the image is plain)."""
    adapter = get_adapter(dataset)
    if not is_stamped(dataset):
        stamped = ", ".join(name for name in dataset_names() if is_stamped(name))
        raise VQADataError(f"dataset {dataset!r} has no stamped marks; stamped datasets: {stamped}", dataset=dataset)
    if split not in adapter.splits:
        allowed = ", ".join(adapter.splits)
        raise VQADataError(f"unknown split {split!r}; allowed splits: {allowed}", dataset=dataset, split=split)
    return adapter.marks(source, split)


def load_vqa(
    name: str,
    split: str,
    source: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    *,
    question_kinds: Sequence[str] = (),
    verify_images: bool = False,
) -> VQADataset:
    """Load one split of a registered dataset as validated ``VQASample``s.

    ``source`` overrides the adapter's default (a hub id, or a local copy: a saved
    dataset directory, a hub snapshot directory, or data files). ``limit`` keeps a
    seeded random subset of that many rows, in source order; the text checks run over
    every kept row before any image is read. ``verify_images`` also decodes every
    image up front, instead of failing later when a bad one is first used.
    ``question_kinds`` keeps only the rows of those kinds, and ``limit`` draws from them
    (every row's text is then read, to find them).
    """
    adapter = get_adapter(name)
    if split not in adapter.splits:
        allowed = ", ".join(adapter.splits)
        raise VQADataError(f"unknown split {split!r}; allowed splits: {allowed}", dataset=name, split=split)
    table = adapter.open(source, split)
    if question_kinds:
        rows = _of_kinds(table.read_rows(range(table.num_rows)), question_kinds, name, split)
        rows = [rows[index] for index in select_rows(len(rows), limit, seed, name, split)]
    else:
        rows = table.read_rows(select_rows(table.num_rows, limit, seed, name, split))
    _raise_for_problems(rows, _text_problem, name, split)
    table.attach_images(rows)
    _raise_for_problems(rows, _image_problem, name, split)
    dataset = VQADataset(name, split, (_sample(row, name, split) for row in rows))
    if verify_images:
        dataset.verify_images()
    return dataset


class UnknownQuestionKind(VQADataError):
    """A question kind asked for that the split has no row of; `present` holds the kinds it has."""

    def __init__(self, unknown: Sequence[str], present: Sequence[str], *, dataset: str, split: str) -> None:
        self.present = tuple(present)
        super().__init__(f"no question of kind {', '.join(map(repr, unknown))}; kinds here: {', '.join(present)}",
                         dataset=dataset, split=split)


def _of_kinds(rows: list[SourceRow], kinds: Sequence[str], name: str, split: str) -> list[SourceRow]:
    present = sorted({row.question_kind for row in rows})
    unknown = [kind for kind in kinds if kind not in present]
    if unknown:
        raise UnknownQuestionKind(unknown, present, dataset=name, split=split)
    return [row for row in rows if row.question_kind in kinds]


def select_rows(num_rows: int, limit: int | None, seed: int, name: str, split: str) -> list[int]:
    """Every row, or a seeded random subset of ``limit`` rows in source order."""
    if limit is None or limit >= num_rows:
        return list(range(num_rows))
    if limit < 1:
        raise VQADataError(f"limit must be a positive number of rows, got {limit}", dataset=name, split=split)
    chosen = np.random.default_rng(seed).choice(num_rows, size=limit, replace=False)
    return sorted(int(index) for index in chosen)


def _text_problem(row: SourceRow, seen_ids: set[str]) -> str | None:
    if not row.question.strip():
        return "empty question"
    if IMAGE_PLACEHOLDER in row.question:
        return f"question contains the image placeholder {IMAGE_PLACEHOLDER!r}"
    if not row.answer.strip():
        return "missing answer"
    if row.answer_type not in ANSWER_TYPES:
        return f"answer type {row.answer_type!r} is not one of {', '.join(ANSWER_TYPES)}"
    if row.id in seen_ids:
        return "duplicate sample id"
    seen_ids.add(row.id)
    return None


def _image_problem(row: SourceRow, seen_ids: set[str]) -> str | None:
    if row.image_ref is not None:
        return None
    return f"missing image ({row.missing_image_reason})" if row.missing_image_reason else "missing image"


def _raise_for_problems(
    rows: list[SourceRow],
    check: Callable[[SourceRow, set[str]], str | None],
    name: str,
    split: str,
) -> None:
    seen_ids: set[str] = set()
    problems = [
        RowProblem(row.row_index, row.id, problem)
        for row in rows
        if (problem := check(row, seen_ids)) is not None
    ]
    if problems:
        raise VQADataError.for_rows(name, split, problems)


def _sample(row: SourceRow, name: str, split: str) -> VQASample:
    assert row.image_ref is not None, "rows without images were rejected above"
    return VQASample(
        id=row.id,
        dataset=name,
        split=split,
        question=row.question.strip(),
        answer=row.answer,
        answer_type=row.answer_type,
        question_kind=row.question_kind,
        image_id=row.image_id,
        source_row=row.row_index,
        answers=row.answers,
        needed_boxes=row.needed_boxes,
        image_ref=row.image_ref,
    )
