"""easy-VQA with a handwritten digit burned into a known share of its images.

Registered as ``easyvqa-stamped``: half of each split's images stamped, seed 0 (see
``vqa.stamping`` for what a mark is and how it is placed). Questions, answers,
sample ids and row order are easy-VQA's; only the pixels of stamped images and the
image ids differ. Image ids carry the stamp spec (``stamped-p0.5-s0/train/12``), so
they never collide with plain easy-VQA's (``train/12``) nor with another spec's in a
feature cache keyed by image id.

Another share or seed is another dataset:
``register_dataset(StampedEasyVQAAdapter("easyvqa-stamped-25", StampSpec(share=0.25)))``.
``source`` is an easy-VQA directory, as for ``easyvqa``. ``vqa.mark_records`` gives the
marks of a split by image id (unstamped images have none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vqa.adapters.easyvqa import EASYVQA, EasyVQATable
from vqa.images import FileImage, ImageRef
from vqa.registry import SourceRow, register_dataset
from vqa.stamping import MarkRecord, SplitImage, StampedImage, StampSpec, plan_marks


class StampedEasyVQATable:
    def __init__(self, plain: EasyVQATable, split: str, spec: StampSpec) -> None:
        self._plain = plain
        self._split = split
        self._spec = spec
        self.marks_by_number = plan_marks(plain.image_paths, split, spec, self.image_id)

    def image_id(self, number: int) -> str:
        return f"{self._spec.tag}/{self._split}/{number}"

    @property
    def num_rows(self) -> int:
        return self._plain.num_rows

    def read_rows(self, indices: Sequence[int]) -> list[SourceRow]:
        return self._plain.read_rows(indices)

    def attach_images(self, rows: list[SourceRow]) -> None:
        self._plain.attach_images(rows)
        for row in rows:
            if row.image_ref is None:
                continue  # reported by load_vqa with the plain table's reason
            number = int(row.image_key)
            row.image_id = self.image_id(number)
            mark = self.marks_by_number.get(number)
            if mark is not None:
                row.image_ref = StampedImage(row.image_ref, mark)

    def images(self) -> list[SplitImage]:
        """Every image of the split in image-number order, stamped where planned."""
        entries = []
        for number, path in sorted(self._plain.image_paths.items()):
            mark = self.marks_by_number.get(number)
            plain = FileImage(Path(path))
            image_ref: ImageRef = plain if mark is None else StampedImage(plain, mark)
            entries.append(SplitImage(number, self.image_id(number), image_ref, mark))
        return entries


@dataclass(frozen=True)
class StampedEasyVQAAdapter:
    name: str = "easyvqa-stamped"
    spec: StampSpec = field(default_factory=StampSpec)
    splits: tuple[str, ...] = EASYVQA.splits
    default_source: str | None = None

    def open(self, source: str | None, split: str) -> StampedEasyVQATable:
        return StampedEasyVQATable(EASYVQA.open(source, split), split, self.spec)

    def marks(self, source: str | None, split: str) -> dict[str, MarkRecord]:
        """The mark of every stamped image of ``split``, by image id."""
        return {mark.image_id: mark for mark in self.open(source, split).marks_by_number.values()}


EASYVQA_STAMPED = register_dataset(StampedEasyVQAAdapter())
