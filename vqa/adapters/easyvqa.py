"""easy-VQA, bundled with the ``easy-vqa`` package: the offline default dataset.

64x64 PNGs of one coloured shape; questions ask about the shape, its colour, or
yes/no. Every answer comes from one 13-word vocabulary, so all samples are "closed";
``question_kind`` (yes/no, shape, color) follows from the answer and gives the
per-kind accuracy. Images are shared by many questions; ``image_id`` is the
package's image number, so images are decoded and partitioned once per image.

``source`` may name a directory with the package's layout (``{split}/questions.json``
holding ``[question, answer, image_id]`` triples and ``{split}/images/{id}.png``), for
generated variants of the benchmark.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import easy_vqa

from vqa.answers import canonical_answer, is_yes_no
from vqa.errors import VQADataError
from vqa.images import FileImage
from vqa.registry import SourceRow, register_dataset
from vqa.sources import require_local_path

SHAPE_ANSWERS = frozenset({"circle", "rectangle", "triangle"})
QUESTION_KINDS = ("yes/no", "shape", "color")

_BUNDLED_SPLITS = {
    "train": (easy_vqa.get_train_questions, easy_vqa.get_train_image_paths),
    "test": (easy_vqa.get_test_questions, easy_vqa.get_test_image_paths),
}
Questions = tuple[list[str], list[str], list[int]]


def question_kind(answer: str) -> str:
    if is_yes_no(answer):
        return "yes/no"
    return "shape" if canonical_answer(answer) in SHAPE_ANSWERS else "color"


class EasyVQATable:
    def __init__(self, questions: Questions, image_paths: dict[int, str], split: str) -> None:
        self._texts, self._answers, self._image_ids = questions
        self._image_paths = image_paths
        self._split = split

    @property
    def num_rows(self) -> int:
        return len(self._texts)

    @property
    def image_paths(self) -> Mapping[int, str]:
        """Every image file of the split by the package's image number, asked about or not."""
        return self._image_paths

    def read_rows(self, indices: Sequence[int]) -> list[SourceRow]:
        return [self._row(index) for index in indices]

    def attach_images(self, rows: list[SourceRow]) -> None:
        for row in rows:
            # The package numbers each split's images from 0: without the split,
            # train image 5 and test image 5 would share one id (and one cached feature).
            row.image_id = f"{self._split}/{row.image_key}"
            path = self._image_paths.get(self._image_ids[row.row_index])
            if path is None:
                row.missing_image_reason = f"no image file for image id {row.image_key}"
            else:
                row.image_ref = FileImage(Path(path))

    def _row(self, index: int) -> SourceRow:
        answer = canonical_answer(self._answers[index])
        return SourceRow(
            row_index=index,
            id=str(index),
            question=str(self._texts[index] or ""),
            answer=answer,
            answer_type="closed",
            question_kind=question_kind(answer),
            image_key=str(self._image_ids[index]),
        )


@dataclass(frozen=True)
class EasyVQAAdapter:
    name: str = "easyvqa"
    splits: tuple[str, ...] = tuple(_BUNDLED_SPLITS)
    default_source: str | None = None

    def open(self, source: str | None, split: str) -> EasyVQATable:
        if source is None:
            read_questions, read_image_paths = _BUNDLED_SPLITS[split]
            return EasyVQATable(read_questions(), read_image_paths(), split)
        return self._open_directory(require_local_path(self.name, source) / split, split)

    def _open_directory(self, split_dir: Path, split: str) -> EasyVQATable:
        questions_file = split_dir / "questions.json"
        try:
            triples = json.loads(questions_file.read_text(encoding="utf-8"))
            columns = zip(*triples, strict=True) if triples else ([], [], [])
            texts, answers, image_ids = (list(column) for column in columns)
        except (OSError, ValueError, TypeError) as err:
            raise VQADataError(
                f"cannot read {questions_file} as [question, answer, image_id] triples: {err}",
                dataset=self.name,
                split=split,
            ) from err
        image_paths = {
            int(path.stem): str(path) for path in (split_dir / "images").glob("*.png") if path.stem.isdigit()
        }
        return EasyVQATable((texts, answers, image_ids), image_paths, split)


EASYVQA = register_dataset(EasyVQAAdapter())
