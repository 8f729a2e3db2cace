"""The generated scene benchmark (`vqa.scenes`) as datasets.

Registered as ``scenes`` (plain) and ``scenes-stamped`` (half of each split's images carry a
handwritten digit in a free cell). Splits: ``train``, ``aux`` (public rows for the attacker,
never a client's) and ``test``. Rows are every image's questions in image order; a row's
``needed_boxes`` are the boxes its question needs. ``source`` is not used: the data is
generated from the spec, so a source is refused rather than ignored.

Another spec is another dataset:
``register_dataset(ScenesAdapter("scenes-small", SceneSpec(images=(("train", 200), ("test", 500)))))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from PIL import Image

from vqa.errors import VQADataError
from vqa.registry import SourceRow, register_dataset
from vqa.scenes import Scene, SceneObject, SceneSpec, generate_scene, render_scene
from vqa.stamping import MarkRecord, SplitImage


@dataclass(frozen=True, eq=False)
class SceneImage:
    """A generated scene, drawn when opened."""

    spec: SceneSpec
    objects: tuple[SceneObject, ...]
    mark: MarkRecord | None

    def open(self) -> Image.Image:
        return render_scene(self.spec, self.objects, self.mark)

    def describe(self) -> str:
        stamped = f", stamped with a {self.mark.digit} at {self.mark.box}" if self.mark else ""
        return f"generated scene of {len(self.objects)} objects{stamped}"


@lru_cache(maxsize=8)
def split_scenes(spec: SceneSpec, split: str) -> tuple[Scene, ...]:
    return tuple(generate_scene(spec, split, number) for number in range(spec.image_count(split)))


class ScenesTable:
    def __init__(self, spec: SceneSpec, split: str) -> None:
        self.scenes = split_scenes(spec, split)
        self._rows = [(scene, index) for scene in self.scenes for index in range(len(scene.questions))]

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def read_rows(self, indices: Sequence[int]) -> list[SourceRow]:
        rows = []
        for index in indices:
            scene, question_index = self._rows[index]
            question = scene.questions[question_index]
            rows.append(SourceRow(
                row_index=index,
                id=f"{scene.split}/{scene.number}/{question_index}",
                question=question.question,
                answer=question.answer,
                answer_type="closed",
                question_kind=question.kind,
                image_key=str(scene.number),
                needed_boxes=question.needed_boxes,
            ))
        return rows

    def attach_images(self, rows: list[SourceRow]) -> None:
        for row in rows:
            scene, _ = self._rows[row.row_index]
            row.image_id = scene.image_id
            row.image_ref = SceneImage(scene.spec, scene.objects, scene.mark)

    def marks(self) -> dict[str, MarkRecord]:
        return {scene.image_id: scene.mark for scene in self.scenes if scene.mark is not None}

    def images(self) -> list[SplitImage]:
        """Every image of the split in number order, asked about or not."""
        return [
            SplitImage(scene.number, scene.image_id, SceneImage(scene.spec, scene.objects, scene.mark), scene.mark)
            for scene in self.scenes
        ]


@dataclass(frozen=True)
class ScenesAdapter:
    name: str = "scenes"
    spec: SceneSpec = field(default_factory=SceneSpec)
    default_source: str | None = None

    @property
    def splits(self) -> tuple[str, ...]:
        return self.spec.splits

    def open(self, source: str | None, split: str) -> ScenesTable:
        if source:
            raise VQADataError(
                f"source={source!r}: the {self.name} benchmark is generated from its spec and reads no source; "
                "leave data.source empty", dataset=self.name, split=split,
            )
        return ScenesTable(self.spec, split)

    def marks(self, source: str | None, split: str) -> dict[str, MarkRecord]:
        """Every stamped image's mark in `split`, by image id (empty for a plain spec)."""
        return self.open(source, split).marks()


SCENES = register_dataset(ScenesAdapter())
SCENES_STAMPED = register_dataset(ScenesAdapter("scenes-stamped", SceneSpec(stamp_share=0.5)))
