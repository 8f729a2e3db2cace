"""Turning whatever a source stores into an RGB PIL image, lazily.

Samples hold an ``ImageRef`` rather than pixels: the large sets would not fit in
memory decoded, and the frozen vision features are cached per image downstream, so
each image is decoded only when someone asks for it.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from vqa.errors import RowProblem, VQADataError

# Transparent pixels become white, the background a viewer would show.
_BACKGROUND = (255, 255, 255)
_ALPHA_MODES = frozenset({"RGBA", "LA", "La", "RGBa", "PA"})
_HIGH_BIT_DEPTH_PREFIXES = ("I", "F")


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode (1, L, P, RGBA, CMYK, YCbCr, 16-bit, float, ...) as 8-bit RGB.

    Sizes are left alone; EXIF orientation is not applied because LLaVA's reference
    preprocessing does not apply it either.
    """
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode.startswith(_HIGH_BIT_DEPTH_PREFIXES):
        return _stretch_to_8bit(image).convert("RGB")
    return image.convert("RGB")


def _stretch_to_8bit(image: Image.Image) -> Image.Image:
    # High bit depth images (16-bit PNG, medical 12-bit in 16-bit containers, float
    # TIFF) have no fixed white level; a full min-max window, as an image viewer
    # would use, keeps the content visible whatever the bit depth.
    pixels = np.asarray(image, dtype=np.float64)
    low, high = float(pixels.min()), float(pixels.max())
    if high <= low:
        return Image.new("L", image.size, 0)
    scaled = (pixels - low) * (255.0 / (high - low))
    return Image.fromarray(np.rint(scaled).astype(np.uint8), mode="L")


def decode_rgb(data: bytes) -> Image.Image:
    return to_rgb(Image.open(io.BytesIO(data)))


class ImageRef(Protocol):
    """Where a sample's image lives; ``open`` decodes it (RGB) on demand."""

    def open(self) -> Image.Image: ...

    def describe(self) -> str: ...


def open_row_image(ref: ImageRef, *, dataset: str, split: str, row: int, item_id: str) -> Image.Image:
    """Decode `ref` (RGB); a failure names the row's dataset, split and row."""
    try:
        return ref.open()
    except Exception as err:  # any decoder failure here is a data problem of this row
        problem = f"unreadable image ({ref.describe()}): {err}"
        raise VQADataError.for_rows(dataset, split, [RowProblem(row, item_id, problem)]) from err


@dataclass(frozen=True)
class FileImage:
    path: Path

    def open(self) -> Image.Image:
        with Image.open(self.path) as image:
            return to_rgb(image).copy()

    def describe(self) -> str:
        return f"file {self.path}"


@dataclass(frozen=True)
class ZipMemberImage:
    archive: Path
    member: str

    def open(self) -> Image.Image:
        with zipfile.ZipFile(self.archive) as archive:
            return decode_rgb(archive.read(self.member))

    def describe(self) -> str:
        return f"{self.member} in {self.archive}"


@dataclass(frozen=True, eq=False)
class DatasetRowImage:
    """One cell of an HF ``datasets`` Image column, read with decoding disabled.

    Holding the (memory-mapped) dataset keeps the reference cheap to create and to
    pickle: only the cache file paths travel, not the pixels.
    """

    dataset: Any
    row: int
    column: str

    def open(self) -> Image.Image:
        cell = self.dataset[self.row][self.column]
        if cell is None:
            raise FileNotFoundError("the image cell is empty")
        if cell.get("bytes"):
            return decode_rgb(cell["bytes"])
        if cell.get("path"):
            return FileImage(Path(cell["path"])).open()
        raise FileNotFoundError("the image cell has neither bytes nor a path")

    def describe(self) -> str:
        return f"column {self.column!r}, table row {self.row}"


@dataclass(frozen=True, eq=False)
class InMemoryImage:
    """An image built in code (synthetic benchmarks, tests)."""

    image: Image.Image

    def open(self) -> Image.Image:
        return to_rgb(self.image.copy())

    def describe(self) -> str:
        return f"in-memory {self.image.mode} image {self.image.size}"
