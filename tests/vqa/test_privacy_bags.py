"""Privacy bags: each of the paper's sets read from a local copy in its hub layout, and
the offline stamped-vs-plain easy-VQA set."""

from __future__ import annotations

import time
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import BAG_LAYOUTS, GOOD_BAG_IMAGES, BagLayout, png_bytes, write_cifar10
from PIL import Image

from vqa import PRIVATE, PUBLIC, VQADataError, load_privacy_bags, load_vqa, mark_records, privacy_bag_names
from vqa.privacy_bags import PAPER_NEGATIVE_SETS, PAPER_POSITIVE_SETS

CORRUPT = b"\x89PNG\r\n\x1a\n this is not a picture"


def test_the_paper_s_sets_and_the_offline_sets_are_registered() -> None:
    assert set(privacy_bag_names()) == {*PAPER_POSITIVE_SETS, *PAPER_NEGATIVE_SETS, "easyvqa-stamped", "scenes-stamped"}
    assert set(PAPER_POSITIVE_SETS) == {"celeba", "nih-chest-xray", "eurosat"}
    assert set(PAPER_NEGATIVE_SETS) == {"mnist", "cifar10"}
    assert {layout.name for layout in BAG_LAYOUTS} == {*PAPER_POSITIVE_SETS, *PAPER_NEGATIVE_SETS}


def test_hub_layout_loads_with_the_set_s_label(bag_layout: BagLayout, tmp_path: Path) -> None:
    source = bag_layout.written(tmp_path, GOOD_BAG_IMAGES)

    bags = load_privacy_bags(bag_layout.name, bag_layout.split, source=source)

    assert len(bags) == len(GOOD_BAG_IMAGES)
    expected_label = PRIVATE if bag_layout.name in PAPER_POSITIVE_SETS else PUBLIC
    assert bag_layout.label == expected_label
    assert {bag.label for bag in bags} == {expected_label}
    assert {(bag.dataset, bag.split) for bag in bags} == {(bag_layout.name, bag_layout.split)}
    assert [bag.source_row for bag in bags] == [0, 1, 2]
    assert [bag.id for bag in bags] == [f"{bag_layout.name}/{bag_layout.split}/{row}" for row in range(3)]
    for bag, picture in zip(bags, GOOD_BAG_IMAGES, strict=True):
        image = bag.image
        assert image.mode == "RGB" and image.size == picture.size
    assert bags[0].image.getpixel((0, 0)) == (180, 120, 90)
    assert bags[1].image.getpixel((0, 0)) == (200, 200, 200)  # MNIST-like grey
    assert bags[2].image.getpixel((0, 0)) == (255, 255, 255)  # transparent on white


def test_the_requested_split_is_read_not_another(bag_layout: BagLayout, tmp_path: Path) -> None:
    """Snapshots hold every split: the one asked for (under the source's name) is read."""
    only_this_split = [Image.new("RGB", (5, 7), (1, 2, 3))] * 4
    bags = load_privacy_bags(bag_layout.name, bag_layout.split, source=bag_layout.written(tmp_path, only_this_split))
    assert len(bags) == 4 and bags[0].image.size == (5, 7)


@pytest.mark.parametrize("name", ["celeba", "nih-chest-xray"])
def test_validation_maps_to_the_source_s_valid_split(name: str, tmp_path: Path) -> None:
    layout = next(layout for layout in BAG_LAYOUTS if layout.name == name)
    source = layout.write(tmp_path, "valid", [Image.new("RGB", (3, 3))] * 2)
    assert len(load_privacy_bags(name, "validation", source=source)) == 2
    assert len(load_privacy_bags(name, "train", source=source)) == len(GOOD_BAG_IMAGES)


def test_cifar10_reads_its_img_column_and_names_the_columns_it_found(tmp_path: Path) -> None:
    assert (
        len(load_privacy_bags("cifar10", "train", source=write_cifar10(tmp_path / "hub", "train", GOOD_BAG_IMAGES)))
        == 3
    )
    renamed = write_cifar10(tmp_path / "renamed", "train", GOOD_BAG_IMAGES, image_column="image")
    with pytest.raises(
        VQADataError, match=r"\[cifar10/train\] source .* lacks the columns img \(columns found: image, label\)"
    ):
        load_privacy_bags("cifar10", "train", source=renamed)


@pytest.mark.parametrize("name", ["mnist", "celeba", "nih-chest-xray", "eurosat"])
def test_a_copy_without_the_image_column_is_refused_with_the_columns_found(name: str, tmp_path: Path) -> None:
    table = datasets.Dataset.from_dict(
        {"picture": [{"bytes": png_bytes(GOOD_BAG_IMAGES[0]), "path": None}], "label": [1]},
        features=datasets.Features({"picture": datasets.Image(), "label": datasets.Value("int64")}),
    )
    datasets.DatasetDict({"train": table}).save_to_disk(tmp_path / "copy")
    with pytest.raises(
        VQADataError, match=rf"\[{name}/train\] .*lacks the columns image \(columns found: picture, label\)"
    ):
        load_privacy_bags(name, "train", source=str(tmp_path / "copy"))


def test_missing_image_cells_are_all_reported_with_their_rows(bag_layout: BagLayout, tmp_path: Path) -> None:
    source = bag_layout.written(tmp_path, [None, *GOOD_BAG_IMAGES, None])
    with pytest.raises(VQADataError) as caught:
        load_privacy_bags(bag_layout.name, bag_layout.split, source=source)
    assert [row.row_index for row in caught.value.rows] == [0, 4]
    assert f"[{bag_layout.name}/{bag_layout.split}] row 0 (id '{bag_layout.name}/{bag_layout.split}/0')" in str(
        caught.value
    )
    assert "cell is empty" in str(caught.value)


def test_an_unreadable_image_names_its_row_when_decoded(bag_layout: BagLayout, tmp_path: Path) -> None:
    bags = load_privacy_bags(
        bag_layout.name, bag_layout.split, source=bag_layout.written(tmp_path, [*GOOD_BAG_IMAGES, CORRUPT])
    )
    where = rf"\[{bag_layout.name}/{bag_layout.split}\] row 3 \(id '{bag_layout.name}/{bag_layout.split}/3'\)"
    with pytest.raises(VQADataError, match=where + ": unreadable image") as caught:
        bags[3].image
    assert caught.value.__cause__ is not None


@pytest.mark.parametrize("name", ["celeba", "nih-chest-xray", "eurosat", "mnist", "cifar10"])
def test_the_default_hub_copy_fails_fast_offline_with_how_to_supply_one(name: str) -> None:
    started = time.monotonic()
    with pytest.raises(VQADataError, match=r"not in the local Hugging Face cache.*source=<path>") as caught:
        load_privacy_bags(name, "train")
    assert time.monotonic() - started < 20
    assert caught.value.__cause__ is not None


def test_unknown_set_and_split_list_the_known_ones() -> None:
    with pytest.raises(
        VQADataError, match=r"unknown privacy bag set 'faces'; known sets: celeba, cifar10, easyvqa-stamped"
    ):
        load_privacy_bags("faces", "train")
    with pytest.raises(
        VQADataError, match=r"\[mnist/validation\] unknown split 'validation'; allowed splits: train, test"
    ):
        load_privacy_bags("mnist", "validation")


def test_limit_draws_a_seeded_subset_in_source_order(tmp_path: Path) -> None:
    source = write_cifar10(tmp_path, "train", [Image.new("RGB", (4, 4), (i, i, i)) for i in range(20)])
    first = load_privacy_bags("cifar10", "train", source=source, limit=5, seed=1)
    assert [bag.id for bag in first] == [
        bag.id for bag in load_privacy_bags("cifar10", "train", source=source, limit=5, seed=1)
    ]
    assert [bag.id for bag in first] != [
        bag.id for bag in load_privacy_bags("cifar10", "train", source=source, limit=5, seed=2)
    ]
    assert [bag.source_row for bag in first] == sorted(bag.source_row for bag in first)
    assert [bag.image.getpixel((0, 0))[0] for bag in first] == [bag.source_row for bag in first]


@pytest.mark.parametrize(("split", "images"), [("train", 4_000), ("test", 1_000)])
def test_offline_bags_are_the_stamped_benchmark_s_images_labelled_by_their_mark(split: str, images: int) -> None:
    bags = load_privacy_bags("easyvqa-stamped", split)
    marks = mark_records("easyvqa-stamped", split)
    assert len(bags) == images and len({bag.id for bag in bags}) == images
    assert {bag.id for bag in bags} == {sample.image_id for sample in load_vqa("easyvqa-stamped", split)}
    assert {bag.id for bag in bags if bag.label == PRIVATE} == set(marks)
    assert sum(bag.label for bag in bags) == images // 2


def test_offline_training_bags_never_hold_an_evaluation_image() -> None:
    train_bags = {bag.id for bag in load_privacy_bags("easyvqa-stamped", "train")}
    evaluated = {sample.image_id for sample in load_vqa("easyvqa-stamped", "test")}
    assert not train_bags & evaluated


def test_offline_bag_pixels_are_the_vqa_dataset_s() -> None:
    bags = {bag.id: bag for bag in load_privacy_bags("easyvqa-stamped", "test", limit=200)}
    checked = 0
    for sample in load_vqa("easyvqa-stamped", "test", limit=300):
        if sample.image_id in bags:
            assert np.array_equal(np.asarray(bags[sample.image_id].image), np.asarray(sample.image))
            checked += 1
    assert checked > 10
