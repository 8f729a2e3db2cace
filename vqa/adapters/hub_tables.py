"""Adapters for sources published as Hugging Face tables: VQA-RAD, PathVQA, GQA,
OK-VQA and VQAv2.

Each adapter is a declaration (default hub id, splits, required columns, a row
converter); ``HFTable`` does the shared work of resolving images lazily.

Conventions, applied uniformly so per-type accuracy means the same everywhere:
answers are canonicalised (lower-case, collapsed whitespace); a sample is "closed"
when its canonical answer is yes/no (VQAv2: when its ``answer_type`` is "yes/no"),
otherwise "open"; sources without question ids use the source row index as id;
sources without an image key use a content digest of the stored image, so questions
about the same picture share an ``image_id``.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc

from vqa.answers import canonical_answer, is_yes_no
from vqa.errors import VQADataError
from vqa.images import DatasetRowImage
from vqa.registry import SourceRow, register_dataset
from vqa.schema import AnswerType
from vqa.sources import is_hub_id, is_saved_dataset, open_hf_split, require_columns


RowConverter = Callable[[dict[str, Any], int], SourceRow]

_IMAGE_BATCH_ROWS = 256


def image_cells(
    images: datasets.Dataset, indices: Sequence[int], with_digest: bool
) -> Iterator[tuple[bool, str]]:
    """(present, content digest or "") per row; bytes are read only when digests are needed."""
    subset = images.select(indices).with_format("arrow")
    for batch in subset.iter(batch_size=_IMAGE_BATCH_ROWS):
        cells = batch.column(0).combine_chunks()
        if with_digest:
            for cell in cells.to_pylist():
                present = cell is not None and bool(cell.get("bytes") or cell.get("path"))
                yield present, _content_digest(cell) if present else ""
        else:
            stored = pc.or_(pc.is_valid(cells.field("bytes")), pc.is_valid(cells.field("path")))
            for present in pc.and_(pc.is_valid(cells), stored).to_pylist():
                yield bool(present), ""


def _content_digest(cell: dict[str, Any]) -> str:
    payload = cell.get("bytes") or str(cell.get("path")).encode()
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def undecoded_image_column(table: datasets.Dataset, column: str) -> datasets.Dataset:
    return table.select_columns([column]).cast_column(column, datasets.Image(decode=False))


class HFTable:
    """A split whose images are a column of the same table, or rows of a keyed image table."""

    def __init__(
        self,
        questions: datasets.Dataset,
        convert: RowConverter,
        images: datasets.Dataset,
        image_row_by_key: dict[str, int] | None = None,
    ) -> None:
        self._questions = questions
        self._convert = convert
        self._images = images
        self._image_row_by_key = image_row_by_key

    @property
    def num_rows(self) -> int:
        return self._questions.num_rows

    def read_rows(self, indices: Sequence[int]) -> list[SourceRow]:
        texts = self._questions.select(indices).to_list()
        return [self._convert(text, index) for text, index in zip(texts, indices, strict=True)]

    def attach_images(self, rows: list[SourceRow]) -> None:
        if self._image_row_by_key is None:
            self._attach_from_column(rows)
            return
        for row in rows:
            row.image_id = row.image_key
            image_row = self._image_row_by_key.get(row.image_key)
            if image_row is None:
                row.missing_image_reason = f"image key {row.image_key!r} is not in the image table"
            else:
                row.image_ref = DatasetRowImage(self._images, image_row, "image")

    def _attach_from_column(self, rows: list[SourceRow]) -> None:
        column = self._images.column_names[0]
        with_digest = any(not row.image_key for row in rows)
        cells = image_cells(self._images, [row.row_index for row in rows], with_digest)
        for row, (present, digest) in zip(rows, cells, strict=True):
            if not present:
                row.missing_image_reason = f"the {column!r} cell is empty"
                continue
            row.image_id = row.image_key or digest
            row.image_ref = DatasetRowImage(self._images, row.row_index, column)


@dataclass(frozen=True)
class HFTableAdapter:
    """A table with question/answer columns and an image column (or a keyed image table).

    ``questions_config``/``images_config`` (templates over ``{split}``) are for sources
    that publish images as a separate configuration keyed by ````SourceRow.image_key````
    (lmms-lab/GQA); they apply to hub ids and snapshot directories, while saved
    datasets and data files are read as flat tables with an image column.
    ``optional_columns`` are passed to the converter when the source has them.
    """

    name: str
    splits: tuple[str, ...]
    default_source: str | None
    question_columns: tuple[str, ...]
    convert: RowConverter
    optional_columns: tuple[str, ...] = ()
    image_column: str = "image"
    questions_config: str | None = None
    images_config: str | None = None

    def open(self, source: str | None, split: str) -> HFTable:
        source = source or self.default_source
        if source is None:
            raise VQADataError("no source given and no default", dataset=self.name, split=split)
        if self.images_config is not None and self._uses_configs(source):
            return self._open_keyed(source, split)
        table = open_hf_split(self.name, source, split)
        require_columns(self.name, split, table, (*self.question_columns, self.image_column), source)
        return HFTable(
            self._text_columns(table), self.convert, undecoded_image_column(table, self.image_column)
        )

    def _text_columns(self, table: datasets.Dataset) -> datasets.Dataset:
        present = [column for column in self.optional_columns if column in table.column_names]
        return table.select_columns([*self.question_columns, *present])

    @staticmethod
    def _uses_configs(source: str) -> bool:
        if is_hub_id(source):
            return True
        path = Path(source).expanduser()
        return path.is_dir() and not is_saved_dataset(path)

    def _open_keyed(self, source: str, split: str) -> HFTable:
        assert self.questions_config is not None and self.images_config is not None
        questions = open_hf_split(self.name, source, split, config=self.questions_config.format(split=split))
        require_columns(self.name, split, questions, self.question_columns, source)
        images = open_hf_split(self.name, source, split, config=self.images_config.format(split=split))
        require_columns(self.name, split, images, ("id", "image"), source)
        image_row_by_key = {str(key): row for row, key in enumerate(images["id"])}
        return HFTable(
            self._text_columns(questions),
            self.convert,
            undecoded_image_column(images, "image"),
            image_row_by_key,
        )


def _closed_if_yes_no(answer: str) -> AnswerType:
    return "closed" if is_yes_no(answer) else "open"


def _yes_no_or_other(answer: str) -> str:
    return "yes/no" if is_yes_no(answer) else "other"


def convert_single_answer(row: dict[str, Any], index: int) -> SourceRow:
    """VQA-RAD and PathVQA (flaviagiammarino copies): image, question, answer."""
    answer = canonical_answer(row["answer"])
    return SourceRow(
        row_index=index,
        id=str(index),
        question=str(row["question"] or ""),
        answer=answer,
        answer_type=_closed_if_yes_no(answer),
        question_kind=_yes_no_or_other(answer),
    )


def convert_gqa(row: dict[str, Any], index: int) -> SourceRow:
    """GQA: the structural type (verify, query, choose, logical, compare) is the kind."""
    answer = canonical_answer(row["answer"])
    structural = (row.get("types") or {}).get("structural")
    return SourceRow(
        row_index=index,
        id=str(row["id"]),
        question=str(row["question"] or ""),
        answer=answer,
        answer_type=_closed_if_yes_no(answer),
        question_kind=structural or _yes_no_or_other(answer),
        image_key=str(row["imageId"]),
    )


def _human_answers(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(canonical_answer(entry["answer"]) for entry in row["answers"] or [])


def _most_common(answers: tuple[str, ...]) -> str:
    # Counter keeps first-seen order among ties, so the choice is deterministic.
    counts = Counter(answer for answer in answers if answer)
    return counts.most_common(1)[0][0] if counts else ""


def convert_okvqa(row: dict[str, Any], index: int) -> SourceRow:
    """OK-VQA: ten human answers; the most frequent is the canonical one."""
    answers = _human_answers(row)
    answer = _most_common(answers)
    return SourceRow(
        row_index=index,
        id=str(row["question_id"]),
        question=str(row["question"] or ""),
        answer=answer,
        answer_type=_closed_if_yes_no(answer),
        question_kind=str(row["question_type"]),
        answers=answers,
    )


def convert_vqav2(row: dict[str, Any], index: int) -> SourceRow:
    """VQAv2: ``multiple_choice_answer`` is the canonical answer; its answer_type is the kind."""
    kind = str(row["answer_type"] or "")
    return SourceRow(
        row_index=index,
        id=str(row["question_id"]),
        question=str(row["question"] or ""),
        answer=canonical_answer(row["multiple_choice_answer"]),
        answer_type="closed" if kind == "yes/no" else "open",
        question_kind=kind,
        image_key=str(row["image_id"]),
        answers=_human_answers(row),
    )


VQA_RAD = register_dataset(
    HFTableAdapter(
        name="vqa-rad",
        splits=("train", "test"),
        default_source="flaviagiammarino/vqa-rad",
        question_columns=("question", "answer"),
        convert=convert_single_answer,
    )
)
PATHVQA = register_dataset(
    HFTableAdapter(
        name="pathvqa",
        splits=("train", "validation", "test"),
        default_source="flaviagiammarino/path-vqa",
        question_columns=("question", "answer"),
        convert=convert_single_answer,
    )
)
GQA = register_dataset(
    HFTableAdapter(
        name="gqa",
        splits=("train", "val", "testdev"),
        default_source="lmms-lab/GQA",
        question_columns=("id", "imageId", "question", "answer"),
        convert=convert_gqa,
        optional_columns=("types",),
        questions_config="{split}_balanced_instructions",
        images_config="{split}_balanced_images",
    )
)
OKVQA = register_dataset(
    HFTableAdapter(
        name="okvqa",
        splits=("train", "validation"),
        default_source="HuggingFaceM4/OK-VQA",
        question_columns=("question_id", "question", "question_type", "answers"),
        convert=convert_okvqa,
    )
)
VQAV2 = register_dataset(
    HFTableAdapter(
        name="vqav2",
        splits=("train", "validation"),
        default_source="HuggingFaceM4/VQAv2",
        question_columns=(
            "question_id",
            "question",
            "image_id",
            "answer_type",
            "multiple_choice_answer",
            "answers",
        ),
        convert=convert_vqav2,
    )
)
