"""The stamped privacy benchmark: where each mark is, which patches hold it, and that
the records, the pixels and the ids agree with each other and with plain easy-VQA."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import Row, write_easyvqa
from PIL import Image
from sklearn.datasets import load_digits

from vqa import (
    MarkRecord,
    StampedEasyVQAAdapter,
    StampSpec,
    VQADataError,
    dataset_names,
    load_vqa,
    mark_patches,
    mark_records,
    register_dataset,
    registry,
)
from vqa.adapters.easyvqa import EASYVQA
from vqa.stamping import MARK_POSITIONS, digit_pools, mark_box, plan_marks, stamp

SPLIT_IMAGES = {"train": 4_000, "test": 1_000}


@pytest.fixture(scope="module")
def test_marks() -> dict[str, MarkRecord]:
    return mark_records("easyvqa-stamped", "test")


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.int64)


def _first_images(split: str, count: int, seed: int = 0):
    """(plain sample, stamped sample) pairs: same question row, one image each."""
    plain = load_vqa("easyvqa", split, limit=count, seed=seed)
    stamped = load_vqa("easyvqa-stamped", split, limit=count, seed=seed)
    return list(zip(plain, stamped, strict=True))


def test_registered_by_name_next_to_plain_easyvqa() -> None:
    assert {"easyvqa", "easyvqa-stamped"} <= set(dataset_names())


@pytest.mark.parametrize("split", ["train", "test"])
def test_questions_answers_and_row_order_are_easyvqa_s(split: str) -> None:
    plain, stamped = load_vqa("easyvqa", split), load_vqa("easyvqa-stamped", split)
    assert [(s.id, s.question, s.answer, s.question_kind, s.source_row) for s in stamped] == [
        (s.id, s.question, s.answer, s.question_kind, s.source_row) for s in plain
    ]
    assert {s.dataset for s in stamped} == {"easyvqa-stamped"}


def test_image_ids_differ_from_plain_easyvqa_and_between_splits() -> None:
    """Feature caches are keyed by image id: a shared id would hand a stamped image's
    features to a plain one, or a training image's to a test question."""
    ids = {split: {s.image_id for s in load_vqa("easyvqa-stamped", split)} for split in SPLIT_IMAGES}
    plain = {split: {s.image_id for s in load_vqa("easyvqa", split)} for split in SPLIT_IMAGES}
    assert not ids["train"] & ids["test"]
    assert not (ids["train"] | ids["test"]) & (plain["train"] | plain["test"])
    assert {split: len(found) for split, found in ids.items()} == SPLIT_IMAGES


def test_another_spec_is_another_dataset_with_its_own_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))  # registered for this test only
    quarter = register_dataset(StampedEasyVQAAdapter("easyvqa-stamped-test-quarter", StampSpec(share=0.25)))
    first = load_vqa(quarter.name, "test", limit=5)[0]
    default = load_vqa("easyvqa-stamped", "test", limit=5)[0]
    assert first.question == default.question and first.image_id != default.image_id
    assert len(mark_records(quarter.name, "test")) == 250


@pytest.mark.parametrize("split", ["train", "test"])
def test_exactly_the_configured_share_is_stamped(split: str) -> None:
    assert len(mark_records("easyvqa-stamped", split)) == SPLIT_IMAGES[split] // 2
    numbers = range(SPLIT_IMAGES[split])
    for share in (0.0, 0.1, 1.0):
        marks = plan_marks(numbers, split, StampSpec(share=share), str)
        assert len(marks) == round(share * SPLIT_IMAGES[split])


def test_share_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="share must be between 0 and 1, got 1.5"):
        StampSpec(share=1.5)


def test_plan_is_deterministic_and_seeded() -> None:
    numbers = range(1_000)
    first = plan_marks(numbers, "test", StampSpec(seed=3), str)
    assert first == plan_marks(reversed(numbers), "test", StampSpec(seed=3), str)
    other = plan_marks(numbers, "test", StampSpec(seed=4), str)
    assert set(first) != set(other)


def test_marks_do_not_depend_on_which_questions_are_loaded(test_marks: dict[str, MarkRecord]) -> None:
    assert mark_records("easyvqa-stamped", "test") == test_marks
    for _, sample in _first_images("test", 40, seed=7):
        mark = test_marks.get(sample.image_id)
        assert (mark is not None) == ("stamped with" in sample.image_ref.describe())


def test_every_corner_is_used_and_each_record_s_box_is_its_corner(test_marks: dict[str, MarkRecord]) -> None:
    positions = Counter(mark.position for mark in test_marks.values())
    assert set(positions) == set(MARK_POSITIONS)
    assert min(positions.values()) > len(test_marks) / 8
    expected = {
        "top-left": (0, 0, 16, 16),
        "top-right": (48, 0, 64, 16),
        "bottom-left": (0, 48, 16, 64),
        "bottom-right": (48, 48, 64, 64),
    }
    for mark in test_marks.values():
        assert mark.box == expected[mark.position] == mark_box(mark.position)


def test_records_are_real_digits_and_train_test_instances_are_disjoint() -> None:
    digits = load_digits()
    used = {}
    for split in SPLIT_IMAGES:
        marks = mark_records("easyvqa-stamped", split).values()
        used[split] = {mark.digit_index for mark in marks}
        for mark in marks:
            assert mark.digit == digits.target[mark.digit_index]
            assert np.array_equal(np.asarray(mark.ink), digits.images[mark.digit_index])
        assert set(Counter(mark.digit for mark in marks)) == set(range(10))
    assert not used["train"] & used["test"]
    pools = digit_pools(0)
    assert used["train"] <= set(pools["train"]) and used["test"] <= set(pools["test"])


def test_pixels_change_exactly_under_the_recorded_ink(test_marks: dict[str, MarkRecord]) -> None:
    """The recorded position, box and ink are where the pixels actually changed."""
    checked = 0
    for plain, stamped in _first_images("test", 60):
        before, after = _pixels(plain.image), _pixels(stamped.image)
        mark = test_marks.get(stamped.image_id)
        if mark is None:
            assert np.array_equal(before, after)
            continue
        changed = (before != after).any(axis=-1)
        ink = np.zeros((64, 64), dtype=bool)
        left, top, right, bottom = mark.box
        ink[top:bottom, left:right] = np.kron(np.asarray(mark.ink) > 0, np.ones((2, 2), dtype=bool))
        assert changed.any()
        assert not (changed & ~ink).any(), "pixels changed outside the recorded ink"
        bright = before.sum(axis=-1) > 3 * 64  # a darkening step always shows on them
        assert not (ink & bright & ~changed).any(), "recorded ink left a bright pixel untouched"
        assert (after[ink] <= before[ink]).all(), "strokes must be darker than what they cover"
        checked += 1
    assert checked >= 20


def _resized_change_patches(before: Image.Image, after: Image.Image, image_size: int, patch_size: int) -> set[int]:
    grid = image_size // patch_size
    old = _pixels(before.resize((image_size, image_size), Image.Resampling.NEAREST))
    new = _pixels(after.resize((image_size, image_size), Image.Resampling.NEAREST))
    changed = (old != new).any(axis=-1).reshape(grid, patch_size, grid, patch_size).any(axis=(1, 3))
    return {int(index) for index in np.flatnonzero(changed)}


@pytest.mark.parametrize(("image_size", "patch_size"), [(64, 8), (128, 16), (256, 16), (192, 8)])
def test_mark_patches_are_the_patches_whose_pixels_the_mark_changed(
    test_marks: dict[str, MarkRecord], image_size: int, patch_size: int
) -> None:
    """Checked against the rendered images resized as a vision tower would see them
    (integer scales, where nearest resizing keeps every inked pixel)."""
    checked = 0
    for plain, stamped in _first_images("test", 40):
        mark = test_marks.get(stamped.image_id)
        if mark is None:
            continue
        # Dark shape pixels under faint ink may not change; compare against ink on white.
        white = Image.new("RGB", (64, 64), (255, 255, 255))
        expected = _resized_change_patches(white, stamp(white, mark), image_size, patch_size)
        assert set(mark_patches(mark, image_size, patch_size)) == expected
        assert _resized_change_patches(plain.image, stamped.image, image_size, patch_size) <= expected
        checked += 1
    assert checked >= 10


def _full_ink(position: str) -> MarkRecord:
    return MarkRecord("x", "test", 8, 0, position, mark_box(position), ((1,) * 8,) * 8)


@pytest.mark.parametrize(
    ("image_size", "patch_size", "rows", "cols"),
    [
        (64, 8, range(2), range(6, 8)),  # mini: 8x8 grid, the mark fills 2x2
        (224, 14, range(4), range(12, 16)),  # DINOv2-S/14: 16x16 grid, 4x4
        (336, 14, range(6), range(18, 24)),  # CLIP-L/14: 24x24 grid, 6x6
    ],
)
def test_a_fully_inked_corner_covers_its_corner_block(
    image_size: int, patch_size: int, rows: range, cols: range
) -> None:
    grid = image_size // patch_size
    expected = tuple(row * grid + col for row in rows for col in cols)
    assert mark_patches(_full_ink("top-right"), image_size, patch_size) == expected


def test_only_inked_cells_count_at_non_integer_scales() -> None:
    # One inked cell: original pixels [2, 4) x [2, 4) -> [7, 14) at 224 px, patch 0 of 14 px.
    single = dataclasses.replace(
        _full_ink("top-left"), ink=tuple(tuple(int(r == c == 1) for c in range(8)) for r in range(8))
    )
    assert mark_patches(single, 224, 14) == (0,)
    # Cell [14, 16) -> [73.5, 84) at 336 px: patches 5 only (70-84), row and column.
    corner = dataclasses.replace(single, ink=tuple(tuple(int(r == c == 7) for c in range(8)) for r in range(8)))
    assert mark_patches(corner, 336, 14) == (5 * 24 + 5,)
    # Cell [2, 4) -> [10.5, 21) at 336 px straddles patches 0 and 1 in both directions.
    assert mark_patches(single, 336, 14) == (0, 1, 24, 25)


def test_mark_patches_refuses_a_grid_that_does_not_tile_the_image() -> None:
    with pytest.raises(ValueError, match="image size 100 is not a whole number of 14-pixel patches"):
        mark_patches(_full_ink("top-left"), 100, 14)


def test_stamping_a_picture_of_another_size_names_the_sample(tmp_path: Path) -> None:
    write_easyvqa(tmp_path, "test", [Row("what shape?", "circle", Image.new("RGB", (32, 32)))] * 2)
    samples = load_vqa("easyvqa-stamped", "test", source=str(tmp_path))
    marks = mark_records("easyvqa-stamped", "test", source=str(tmp_path))
    stamped = next(sample for sample in samples if sample.image_id in marks)
    where = rf"\[easyvqa-stamped/test\] row {stamped.source_row} \(id '{stamped.id}'\)"
    with pytest.raises(VQADataError, match=where + ".*draws into 64x64 images, got 32x32"):
        stamped.image


def test_marks_of_a_plain_dataset_or_unknown_split_are_refused() -> None:
    with pytest.raises(
        VQADataError, match=r"dataset 'easyvqa' has no stamped marks; stamped datasets: easyvqa-stamped"
    ):
        mark_records("easyvqa", "test")
    with pytest.raises(VQADataError, match=r"unknown split 'dev'; allowed splits: train, test"):
        mark_records("easyvqa-stamped", "dev")


def test_mini_grid_marks_hold_three_or_four_patches(test_marks: dict[str, MarkRecord]) -> None:
    sizes = Counter(len(mark_patches(mark, 64, 8)) for mark in test_marks.values())
    assert set(sizes) <= {1, 2, 3, 4} and sizes[4] > 0.9 * len(test_marks)


def test_a_local_easyvqa_copy_is_stamped_by_its_own_plan(tmp_path: Path) -> None:
    split_dir = tmp_path / "test"
    (split_dir / "images").mkdir(parents=True)
    plain = EASYVQA.open(None, "test")
    for number in range(10):
        Image.open(plain.image_paths[number]).save(split_dir / "images" / f"{number}.png")
    (split_dir / "questions.json").write_text('[["what shape is this?", "circle", 3], ["what color?", "red", 7]]')
    samples = load_vqa("easyvqa-stamped", "test", source=str(tmp_path))
    marks = mark_records("easyvqa-stamped", "test", source=str(tmp_path))
    assert len(marks) == 5
    assert [s.image_id for s in samples] == ["stamped-p0.5-s0/test/3", "stamped-p0.5-s0/test/7"]
    for sample in samples:
        mark = marks.get(sample.image_id)
        expected = Image.open(plain.image_paths[int(sample.image_id.rsplit("/", 1)[1])]).convert("RGB")
        if mark is not None:
            expected = stamp(expected, mark)
        assert np.array_equal(_pixels(sample.image), _pixels(expected))
