"""Image-level privacy labels for the sensitivity teacher (H_sens, trained as multiple-
instance learning): every image of a positive set "contains private content", every
image of a negative set does not. These labels never enter the VQA loop.

The paper's sets, read through HF ``datasets`` from a hub id already in the local
cache or a local copy (``save_to_disk`` folder, hub snapshot folder, or a data file),
never downloaded when offline — the same machinery and errors as the VQA adapters:

| name | label | default source | image column | splits (source's names) |
|---|---|---|---|---|
| celeba | private | flwrlabs/celeba (config img_align+identity+attr) | image | train, validation (valid), test |
| nih-chest-xray | private | BahaaEldin0/NIH-Chest-Xray-14 | image | train, validation (valid), test |
| eurosat | private | blanchon/EuroSAT_RGB | image | train, validation, test |
| mnist | public | ylecun/mnist | image | train, test |
| cifar10 | public | uoft-cs/cifar10 | img | train, test |

Only the image column is read: the label of a bag comes from its set, not from the
source's class columns.

The offline set ``easyvqa-stamped``: the images of the ``easyvqa-stamped`` VQA dataset,
stamped ones positive, plain ones negative (half each), ids equal to that dataset's
image ids. Its ``train`` split is easy-VQA's training images, so the teacher never
trains on the images VQA is evaluated on; ``test`` is the evaluation images, for
measuring the teacher only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import datasets
from PIL import Image

from vqa.adapters.hub_tables import image_cells, undecoded_image_column
from vqa.errors import RowProblem, VQADataError
from vqa.images import DatasetRowImage, ImageRef, open_row_image
from vqa.registry import get_adapter, is_stamped, select_rows
from vqa.stamping import SplitImage
from vqa.sources import open_hf_split, require_columns

PRIVATE = 1
PUBLIC = 0


@dataclass(frozen=True)
class BagImage:
    """One image with its bag label (``PRIVATE`` or ``PUBLIC``), decoded on demand.

    ``id`` is unique across sets and splits (``mnist/train/17``; the stamped set uses
    its VQA dataset's image ids, so vision features can be shared); ``source_row`` is
    the row in the source split (the image number for easy-VQA), for messages.
    """

    id: str
    dataset: str
    split: str
    label: int
    source_row: int
    image_ref: ImageRef = field(repr=False, compare=False, kw_only=True)

    @property
    def image(self) -> Image.Image:
        """The decoded RGB image; a failure names this image's set, split and row."""
        return open_row_image(
            self.image_ref, dataset=self.dataset, split=self.split, row=self.source_row, item_id=self.id
        )


class BagTable(Protocol):
    @property
    def num_rows(self) -> int: ...

    def images(self, rows: Sequence[int]) -> list[BagImage]:
        """The images at ``rows``; rows without an image are reported in one error."""
        ...


class PrivacyBagSet(Protocol):
    name: str
    splits: tuple[str, ...]
    default_source: str | None

    def open(self, source: str | None, split: str) -> BagTable: ...


class HFBagTable:
    def __init__(self, name: str, split: str, label: int, images: datasets.Dataset) -> None:
        self._name = name
        self._split = split
        self._label = label
        self._images = images

    @property
    def num_rows(self) -> int:
        return self._images.num_rows

    def images(self, rows: Sequence[int]) -> list[BagImage]:
        column = self._images.column_names[0]
        present = [is_present for is_present, _ in image_cells(self._images, rows, with_digest=False)]
        problems = [
            RowProblem(row, self._id(row), f"the {column!r} cell is empty")
            for row, is_present in zip(rows, present, strict=True)
            if not is_present
        ]
        if problems:
            raise VQADataError.for_rows(self._name, self._split, problems)
        return [
            BagImage(
                self._id(row),
                self._name,
                self._split,
                self._label,
                row,
                image_ref=DatasetRowImage(self._images, row, column),
            )
            for row in rows
        ]

    def _id(self, row: int) -> str:
        return f"{self._name}/{self._split}/{row}"


@dataclass(frozen=True)
class HFBagSet:
    """A set published as an HF table whose every image carries the set's label.

    ``source_splits`` maps this package's split names to the source's; ``config``
    names the hub configuration (hub ids and snapshot folders only).
    """

    name: str
    label: int
    default_source: str
    image_column: str
    source_splits: Mapping[str, str]
    config: str | None = None

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.source_splits)

    def open(self, source: str | None, split: str) -> HFBagTable:
        source = source or self.default_source
        table = open_hf_split(self.name, source, self.source_splits[split], config=self.config)
        require_columns(self.name, split, table, (self.image_column,), source)
        return HFBagTable(self.name, split, self.label, undecoded_image_column(table, self.image_column))


class StampedBagTable:
    def __init__(self, name: str, split: str, images: list[SplitImage]) -> None:
        self._name = name
        self._split = split
        self._images = images

    @property
    def num_rows(self) -> int:
        return len(self._images)

    def images(self, rows: Sequence[int]) -> list[BagImage]:
        return [
            BagImage(
                entry.image_id,
                self._name,
                self._split,
                PUBLIC if entry.mark is None else PRIVATE,
                entry.number,
                image_ref=entry.image_ref,
            )
            for entry in (self._images[row] for row in rows)
        ]


@dataclass(frozen=True)
class StampedBagSet:
    """Stamped (private) vs plain (public) images of a registered stamped VQA dataset."""

    name: str = "easyvqa-stamped"
    dataset: str = "easyvqa-stamped"
    splits: tuple[str, ...] = ("train", "test")
    default_source: str | None = None

    def open(self, source: str | None, split: str) -> StampedBagTable:
        if not is_stamped(self.dataset):
            raise VQADataError(f"bag set {self.name!r}: dataset {self.dataset!r} records no stamps", dataset=self.dataset)
        table = get_adapter(self.dataset).open(source, split)
        return StampedBagTable(self.name, split, table.images())


_BAG_SETS: dict[str, PrivacyBagSet] = {}


def register_privacy_bags(bag_set: PrivacyBagSet, *, replace: bool = False) -> PrivacyBagSet:
    if bag_set.name in _BAG_SETS and not replace:
        raise ValueError(f"privacy bag set {bag_set.name!r} is already registered; pass replace=True to override it")
    _BAG_SETS[bag_set.name] = bag_set
    return bag_set


def privacy_bag_names() -> tuple[str, ...]:
    return tuple(sorted(_BAG_SETS))


def load_privacy_bags(
    name: str, split: str, source: str | None = None, limit: int | None = None, seed: int = 0
) -> tuple[BagImage, ...]:
    """The images of one split of a registered bag set, each with its label.

    ``source`` overrides the set's default (hub id or local copy); ``limit`` keeps a
    seeded random subset of that many images, in source order (the paper caps each
    set at 3,000). Images are decoded when ``BagImage.image`` is read.
    """
    try:
        bag_set = _BAG_SETS[name]
    except KeyError:
        known = ", ".join(privacy_bag_names())
        raise VQADataError(f"unknown privacy bag set {name!r}; known sets: {known}", dataset=name) from None
    if split not in bag_set.splits:
        allowed = ", ".join(bag_set.splits)
        raise VQADataError(f"unknown split {split!r}; allowed splits: {allowed}", dataset=name, split=split)
    table = bag_set.open(source, split)
    return tuple(table.images(select_rows(table.num_rows, limit, seed, name, split)))


CELEBA = register_privacy_bags(
    HFBagSet(
        name="celeba",
        label=PRIVATE,
        default_source="flwrlabs/celeba",
        image_column="image",
        source_splits={"train": "train", "validation": "valid", "test": "test"},
        config="img_align+identity+attr",
    )
)
NIH_CHEST_XRAY = register_privacy_bags(
    HFBagSet(
        name="nih-chest-xray",
        label=PRIVATE,
        default_source="BahaaEldin0/NIH-Chest-Xray-14",
        image_column="image",
        source_splits={"train": "train", "validation": "valid", "test": "test"},
    )
)
EUROSAT = register_privacy_bags(
    HFBagSet(
        name="eurosat",
        label=PRIVATE,
        default_source="blanchon/EuroSAT_RGB",
        image_column="image",
        source_splits={"train": "train", "validation": "validation", "test": "test"},
    )
)
MNIST = register_privacy_bags(
    HFBagSet(
        name="mnist",
        label=PUBLIC,
        default_source="ylecun/mnist",
        image_column="image",
        source_splits={"train": "train", "test": "test"},
    )
)
CIFAR10 = register_privacy_bags(
    HFBagSet(
        name="cifar10",
        label=PUBLIC,
        default_source="uoft-cs/cifar10",
        image_column="img",
        source_splits={"train": "train", "test": "test"},
    )
)
EASYVQA_STAMPED_BAGS = register_privacy_bags(StampedBagSet())
SCENES_STAMPED_BAGS = register_privacy_bags(
    StampedBagSet(name="scenes-stamped", dataset="scenes-stamped", splits=("train", "aux", "test"))
)

PAPER_POSITIVE_SETS = ("celeba", "nih-chest-xray", "eurosat")
PAPER_NEGATIVE_SETS = ("mnist", "cifar10")
