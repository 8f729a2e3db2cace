"""SLAKE: the original release's layout (also the BoKelvin/SLAKE hub copy).

A directory with one JSON list per split (``train.json``, ``validation.json`` or the
original ``validate.json``, ``test.json``) and the images under ``imgs/`` or inside
``imgs.zip`` as shipped by the hub copy. Rows carry ``img_name``, ``question``,
``answer``, ``answer_type`` (CLOSED/OPEN), ``q_lang`` (en/zh), ``content_type``, ``qid``.
Only English rows are kept, as in the paper; row indices stay those of the JSON list.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download

from vqa.answers import canonical_answer
from vqa.errors import VQADataError
from vqa.images import FileImage, ImageRef, ZipMemberImage
from vqa.registry import SourceRow, register_dataset
from vqa.sources import from_hub_cache_first, is_hub_id, require_local_path

_SPLIT_FILES = {
    "train": ("train.json",),
    "validation": ("validation.json", "validate.json"),
    "test": ("test.json",),
}
_REQUIRED_FIELDS = ("img_name", "question", "answer", "answer_type", "q_lang")
_KEPT_LANGUAGE = "en"


class _ImageFolder:
    """Resolves ``img_name`` under ``imgs/`` or inside ``imgs.zip``."""

    def __init__(self, root: Path) -> None:
        self._folder = root / "imgs"
        self._archive = root / "imgs.zip"
        self._members: frozenset[str] = frozenset()
        if not self._folder.is_dir() and self._archive.is_file():
            with zipfile.ZipFile(self._archive) as archive:
                self._members = frozenset(archive.namelist())

    def describe(self, image_name: str) -> str:
        if self._folder.is_dir():
            return f"no file {self._folder / image_name}"
        return f"no imgs/ folder, nor {image_name} in {self._archive}"

    def find(self, image_name: str) -> ImageRef | None:
        if self._folder.is_dir():
            path = self._folder / image_name
            return FileImage(path) if path.is_file() else None
        for member in (f"imgs/{image_name}", image_name):
            if member in self._members:
                return ZipMemberImage(self._archive, member)
        return None


class SlakeTable:
    def __init__(self, records: list[dict[str, Any]], images: _ImageFolder) -> None:
        self._english_rows = [
            index for index, record in enumerate(records) if record.get("q_lang") == _KEPT_LANGUAGE
        ]
        self._records = records
        self._images = images

    @property
    def num_rows(self) -> int:
        return len(self._english_rows)

    def read_rows(self, indices: Sequence[int]) -> list[SourceRow]:
        return [self._row(self._english_rows[index]) for index in indices]

    def attach_images(self, rows: list[SourceRow]) -> None:
        for row in rows:
            row.image_id = row.image_key
            row.image_ref = self._images.find(row.image_key) if row.image_key else None
            if row.image_ref is None:
                row.missing_image_reason = self._images.describe(row.image_key) if row.image_key else "no img_name"

    def _row(self, row_index: int) -> SourceRow:
        record = self._records[row_index]
        return SourceRow(
            row_index=row_index,
            id=str(record.get("qid", row_index)),
            question=str(record.get("question") or ""),
            answer=canonical_answer(record.get("answer")),
            answer_type=str(record.get("answer_type") or "").lower(),  # type: ignore[arg-type]
            question_kind=str(record.get("content_type") or "other").lower(),
            image_key=str(record.get("img_name") or ""),
        )


@dataclass(frozen=True)
class SlakeAdapter:
    name: str = "slake"
    splits: tuple[str, ...] = tuple(_SPLIT_FILES)
    default_source: str | None = "BoKelvin/SLAKE"

    def open(self, source: str | None, split: str) -> SlakeTable:
        source = source or self.default_source
        assert source is not None
        root = self._local_root(source, split)
        split_file = next((root / name for name in _SPLIT_FILES[split] if (root / name).is_file()), None)
        if split_file is None:
            expected = " or ".join(_SPLIT_FILES[split])
            raise VQADataError(f"{root} has no {expected}", dataset=self.name, split=split)
        records = self._read_records(split_file, split)
        return SlakeTable(records, _ImageFolder(root))

    def _local_root(self, source: str, split: str) -> Path:
        if is_hub_id(source):
            return Path(
                from_hub_cache_first(
                    self.name,
                    split,
                    source,
                    lambda: snapshot_download(source, repo_type="dataset"),
                )
            )
        return require_local_path(self.name, source)

    def _read_records(self, split_file: Path, split: str) -> list[dict[str, Any]]:
        try:
            records = json.loads(split_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise VQADataError(f"cannot read {split_file}: {err}", dataset=self.name, split=split) from err
        if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
            raise VQADataError(f"{split_file} is not a JSON list of objects", dataset=self.name, split=split)
        found = set().union(*(record.keys() for record in records)) if records else set()
        missing = [field for field in _REQUIRED_FIELDS if field not in found]
        if missing:
            raise VQADataError(
                f"{split_file} lacks the columns {', '.join(missing)} "
                f"(columns found: {', '.join(sorted(found))})",
                dataset=self.name,
                split=split,
            )
        return records


SLAKE = register_dataset(SlakeAdapter())
