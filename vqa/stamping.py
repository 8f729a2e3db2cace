"""A privacy benchmark with ground truth: a handwritten digit burned into easy-VQA images.

Real medical sets say what is in an image, not which pixels are private. Here a real
handwritten digit from scikit-learn's bundled ``load_digits`` (8x8 cells, 16 grey
levels) stands for a burned-in patient ID: it is drawn as dark strokes into one of
the four corners of a known share of the images, so "was the mark's patch pruned?"
and "can an attacker read the ID back?" have exact answers. Nothing asks about it:
questions and answers stay easy-VQA's.

Everything is decided by ``StampSpec`` (share, seed) and the split's image numbers:
which images are stamped, in which corner, with which digit instance. Training and
test images draw their digits from disjoint instances, so a probe trained to read the
digit on training images is tested on handwriting it has never seen.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from vqa.images import ImageRef

# easy-VQA's images are 64x64; the mark is a quarter of the side, 16 px, so each digit
# cell is a 2x2 block and a corner mark fills exactly 2x2 patches of the mini model's
# 8-px grid (4x4 of a 16x16 DINOv2 grid, 6x6 of CLIP's 24x24 grid).
IMAGE_SIDE = 64
MARK_SIDE = IMAGE_SIDE // 4
DIGIT_SIDE = 8
DIGIT_LEVELS = 16
MARK_POSITIONS = ("top-left", "top-right", "bottom-left", "bottom-right")
# Black, the darkest stroke: easy-VQA backgrounds are all light, so it shows everywhere.
INK_RGB = (0, 0, 0)
# Share of scikit-learn's 1,797 digit instances kept for stamping test images.
TEST_DIGIT_SHARE = 0.3
DIGIT_POOLS = ("train", "test")

Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class StampSpec:
    """How a stamped benchmark is made: the share of images stamped and the seed.

    ``tag`` names the spec in image ids, so two specs never share a cached feature.
    """

    share: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"stamped share must be between 0 and 1, got {self.share}")

    @property
    def tag(self) -> str:
        return f"stamped-p{self.share:g}-s{self.seed}"


@dataclass(frozen=True)
class MarkRecord:
    """Where and what the mark of one stamped image is.

    ``box`` is (left, top, right, bottom), right/bottom exclusive, in pixels of the
    ``image_side`` x ``image_side`` original; ``ink`` is the digit's 8x8 grey levels
    (0-16, rows top to bottom) exactly as drawn, ``digit`` its label and
    ``digit_index`` its row in ``sklearn.datasets.load_digits()``.
    """

    image_id: str
    split: str
    digit: int
    digit_index: int
    position: str
    box: Box
    ink: tuple[tuple[int, ...], ...]
    image_side: int = IMAGE_SIDE


@lru_cache(maxsize=1)
def digit_images() -> tuple[np.ndarray, np.ndarray]:
    digits = load_digits()
    return digits.images.astype(np.int64), digits.target.astype(np.int64)


@lru_cache(maxsize=8)
def digit_pools(seed: int) -> dict[str, np.ndarray]:
    """Disjoint ``load_digits`` row indices for stamping training and test images,
    stratified by digit so both pools hold every digit in the same proportions."""
    _, labels = digit_images()
    train, test = train_test_split(
        np.arange(len(labels)), test_size=TEST_DIGIT_SHARE, stratify=labels, random_state=seed
    )
    return {"train": np.sort(train), "test": np.sort(test)}


def mark_box(position: str) -> Box:
    if position not in MARK_POSITIONS:
        raise ValueError(f"unknown mark position {position!r}; known positions: {', '.join(MARK_POSITIONS)}")
    right_side, bottom_side = position.endswith("right"), position.startswith("bottom")
    left = IMAGE_SIDE - MARK_SIDE if right_side else 0
    top = IMAGE_SIDE - MARK_SIDE if bottom_side else 0
    return left, top, left + MARK_SIDE, top + MARK_SIDE


def plan_marks(
    image_numbers: Iterable[int], split: str, spec: StampSpec, image_id: Callable[[int], str]
) -> dict[int, MarkRecord]:
    """The mark of every stamped image of ``split``, by image number.

    Exactly ``round(share * images)`` images are stamped. Depends only on the spec, the
    split and the set of image numbers, never on which questions are loaded.
    """
    if split not in DIGIT_POOLS:
        raise ValueError(f"no digit pool for split {split!r}; pools: {', '.join(DIGIT_POOLS)}")
    numbers = sorted(set(image_numbers))
    # crc32, not hash(): Python salts str hashes per process.
    rng = np.random.default_rng([spec.seed, zlib.crc32(split.encode())])
    count = round(spec.share * len(numbers))
    stamped = sorted(int(number) for number in rng.choice(numbers, size=count, replace=False))
    positions = rng.integers(len(MARK_POSITIONS), size=count)
    # Whole shuffled passes over the pool: every instance is used before any repeats.
    pool = digit_pools(spec.seed)[split]
    passes = max(1, -(-count // len(pool)))
    digit_rows = np.concatenate([rng.permutation(pool) for _ in range(passes)])[:count]
    images, labels = digit_images()
    marks = {}
    for number, position_index, digit_row in zip(stamped, positions, digit_rows, strict=True):
        position = MARK_POSITIONS[position_index]
        marks[number] = MarkRecord(
            image_id=image_id(number),
            split=split,
            digit=int(labels[digit_row]),
            digit_index=int(digit_row),
            position=position,
            box=mark_box(position),
            ink=tuple(tuple(int(level) for level in row) for row in images[digit_row]),
        )
    return marks


def stamp(image: Image.Image, mark: MarkRecord) -> Image.Image:
    """``image`` with the mark's digit drawn in: each cell darkens its 2x2 block by level/16."""
    expected = (mark.image_side, mark.image_side)
    if image.size != expected:
        raise ValueError(
            f"this mark draws into {expected[0]}x{expected[1]} images, "
            f"got {image.size[0]}x{image.size[1]}"
        )
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64).copy()
    cell = np.ones(((mark.box[2] - mark.box[0]) // DIGIT_SIDE,) * 2)
    alpha = np.kron(np.asarray(mark.ink, dtype=np.float64) / DIGIT_LEVELS, cell)[..., None]
    left, top, right, bottom = mark.box
    region = pixels[top:bottom, left:right]
    pixels[top:bottom, left:right] = region * (1.0 - alpha) + np.asarray(INK_RGB, dtype=np.float64) * alpha
    return Image.fromarray(np.rint(pixels).astype(np.uint8), mode="RGB")


def mark_patches(mark: MarkRecord, image_size: int, patch_size: int) -> tuple[int, ...]:
    """Row-major indices of the patches that hold ink of the mark, for a vision tower
    that sees the original resized to ``image_size`` x ``image_size`` and cuts it into
    ``patch_size`` patches (mini: 64/8 -> 8x8 grid; DINOv2-S/14: 224/14; CLIP-L/14: 336/14).

    A patch holds the mark when any inked cell (level > 0) overlaps it, computed
    exactly in integers. Assumes a plain resize; a centre crop (DINOv2's reference
    preprocessing) would move the grid.
    """
    if patch_size < 1 or image_size < patch_size or image_size % patch_size:
        raise ValueError(f"image size {image_size} is not a whole number of {patch_size}-pixel patches")
    grid = image_size // patch_size
    left, top = mark.box[0], mark.box[1]
    cell = (mark.box[2] - left) // DIGIT_SIDE
    patches: set[int] = set()
    for cell_row, cell_col in zip(*np.nonzero(np.asarray(mark.ink)), strict=True):
        x0, y0 = left + int(cell_col) * cell, top + int(cell_row) * cell
        rows = _patches_over(y0, y0 + cell, mark.image_side, image_size, patch_size)
        cols = _patches_over(x0, x0 + cell, mark.image_side, image_size, patch_size)
        patches.update(row * grid + col for row in rows for col in cols)
    return tuple(sorted(patches))


def _patches_over(start: int, stop: int, original: int, image_size: int, patch_size: int) -> range:
    # Original pixels [start, stop) become [start, stop) * image_size / original after the
    # resize; patch j spans [j, j + 1) * patch_size. Cross-multiplied to stay in integers.
    scale = patch_size * original
    first = start * image_size // scale
    last = -(-stop * image_size // scale) - 1
    return range(first, last + 1)


@dataclass(frozen=True)
class SplitImage:
    """One image of a stamped benchmark's split, asked about or not; ``mark`` is None when it is plain."""

    number: int
    image_id: str
    image_ref: ImageRef
    mark: MarkRecord | None


@dataclass(frozen=True, eq=False)
class StampedImage:
    """An image reference with the mark drawn in when it is opened."""

    base: ImageRef
    mark: MarkRecord

    def open(self) -> Image.Image:
        return stamp(self.base.open(), self.mark)

    def describe(self) -> str:
        return f"{self.base.describe()} stamped with a {self.mark.digit} at {self.mark.position}"
