"""Every adapter, loaded through the path a user takes with a local copy of its source."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import EXPECTED_ANSWERS, GOOD_ROWS, LAYOUTS, Row, SourceLayout, layout_of, png_bytes
from PIL import Image

from vqa import VQADataError, dataset_names, get_adapter, load_vqa


def test_every_paper_benchmark_and_easyvqa_is_registered() -> None:
    # easyvqa-stamped reads easy-VQA's layout; its own tests are in test_stamping.py, and the
    # generated scenes' in test_scenes.py.
    paper_and_easyvqa = {"easyvqa", "vqa-rad", "slake", "pathvqa", "gqa", "okvqa", "vqav2"}
    assert set(dataset_names()) == paper_and_easyvqa | {"easyvqa-stamped", "scenes", "scenes-stamped"}
    assert {layout.dataset for layout in LAYOUTS} == paper_and_easyvqa


def test_real_layout_maps_to_the_schema(layout: SourceLayout, tmp_path: Path) -> None:
    source = layout.write(tmp_path, layout.split, GOOD_ROWS)

    samples = load_vqa(layout.dataset, layout.split, source=source)

    assert len(samples) == len(GOOD_ROWS)
    assert [sample.answer for sample in samples] == list(EXPECTED_ANSWERS)
    assert [sample.question for sample in samples] == [row.question for row in GOOD_ROWS]
    assert [sample.source_row for sample in samples] == [layout.row_stride * i for i in range(len(GOOD_ROWS))]
    assert len({sample.id for sample in samples}) == len(samples)
    assert {(sample.dataset, sample.split) for sample in samples} == {(layout.dataset, layout.split)}
    assert samples[0].answer_type == "closed"
    for sample, row in zip(samples, GOOD_ROWS):
        image = sample.image
        assert image.mode == "RGB"
        assert isinstance(row.image, Image.Image) and image.size == row.image.size
    # The fully transparent pixel of the RGBA image is composited on white.
    assert samples[2].image.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("dataset", ["vqa-rad", "slake", "pathvqa", "gqa", "okvqa"])
def test_open_answers_are_open_and_yes_no_closed(dataset: str, tmp_path: Path) -> None:
    layout = layout_of(dataset)
    samples = load_vqa(dataset, layout.split, source=layout.write(tmp_path, layout.split, GOOD_ROWS))
    assert [sample.answer_type for sample in samples] == ["closed", "open", "open"]


def test_vqa_style_sources_keep_all_ten_human_answers(tmp_path: Path) -> None:
    for dataset in ("okvqa", "vqav2"):
        layout = layout_of(dataset)
        samples = load_vqa(dataset, layout.split, source=layout.write(tmp_path / dataset, layout.split, GOOD_ROWS))
        assert samples[1].answers == ("left lung",) * 6 + ("something else",) * 4
        assert samples[1].answer == "left lung"


def test_vqav2_ids_and_kinds_come_from_the_source(tmp_path: Path) -> None:
    source = layout_of("vqav2").write(tmp_path, "validation", GOOD_ROWS)
    samples = load_vqa("vqav2", "validation", source=source)
    assert [sample.id for sample in samples] == ["9000000", "9000001", "9000002"]
    assert [sample.image_id for sample in samples] == ["9000", "9001", "9002"]
    assert [sample.question_kind for sample in samples] == ["yes/no", "other", "other"]


def test_gqa_joins_the_image_table_by_image_id_and_uses_structural_type(tmp_path: Path) -> None:
    layout = layout_of("gqa")
    samples = load_vqa("gqa", "testdev", source=layout.write(tmp_path, "testdev", GOOD_ROWS))
    assert [sample.image_id for sample in samples] == ["n161313", "n161314", "n161315"]
    assert [sample.question_kind for sample in samples] == ["verify", "query", "query"]


def test_slake_keeps_english_rows_and_uses_its_own_answer_type(tmp_path: Path) -> None:
    layout = layout_of("slake")
    samples = load_vqa("slake", "validation", source=layout.write(tmp_path, "validation", GOOD_ROWS))
    assert len(samples) == len(GOOD_ROWS)
    assert [sample.id for sample in samples] == ["0", "2", "4"]
    assert [sample.question_kind for sample in samples] == ["abnormality", "organ", "organ"]


def test_questions_about_one_picture_share_an_image_id_without_an_image_key(tmp_path: Path) -> None:
    picture = Image.new("RGB", (12, 12), (1, 2, 3))
    rows = [Row("is it red?", "no", picture), Row("what colour?", "blue", picture), GOOD_ROWS[0]]
    layout = layout_of("vqa-rad")
    samples = load_vqa("vqa-rad", "train", source=layout.write(tmp_path, "train", rows))
    assert samples[0].image_id == samples[1].image_id != samples[2].image_id


CORRUPT = b"\x89PNG\r\n\x1a\n this is not a picture"


@pytest.mark.parametrize(
    ("bad_row", "problem"),
    [
        (Row("   ", "yes", GOOD_ROWS[0].image), "empty question"),
        (Row("is it?", None, GOOD_ROWS[0].image), "missing answer"),
        (Row("is it?", "yes", None), "missing image"),
    ],
    ids=["empty-question", "missing-answer", "missing-image"],
)
def test_bad_rows_are_reported_up_front_with_their_place(
    layout: SourceLayout, tmp_path: Path, bad_row: Row, problem: str
) -> None:
    rows = [*GOOD_ROWS, bad_row]
    source = layout.write(tmp_path, layout.split, rows)

    with pytest.raises(VQADataError) as caught:
        load_vqa(layout.dataset, layout.split, source=source)

    bad_index = layout.row_stride * (len(rows) - 1)
    message = str(caught.value)
    assert f"[{layout.dataset}/{layout.split}]" in message
    assert f"row {bad_index} (id " in message
    assert problem in message
    assert [row.row_index for row in caught.value.rows] == [bad_index]


def test_unreadable_image_names_the_row_when_decoded_or_verified(layout: SourceLayout, tmp_path: Path) -> None:
    source = layout.write(tmp_path, layout.split, [*GOOD_ROWS, Row("is it?", "yes", CORRUPT)])
    bad_index = layout.row_stride * len(GOOD_ROWS)

    samples = load_vqa(layout.dataset, layout.split, source=source)
    where = rf"\[{layout.dataset}/{layout.split}\] row {bad_index} \(id '[^']+'\)"
    with pytest.raises(VQADataError, match=where + ": unreadable image") as caught:
        samples[-1].image
    assert caught.value.__cause__ is not None

    with pytest.raises(VQADataError, match=rf"row {bad_index} .*unreadable image"):
        load_vqa(layout.dataset, layout.split, source=source, verify_images=True)


def test_every_bad_row_is_listed_in_one_error(tmp_path: Path) -> None:
    layout = layout_of("vqa-rad")
    rows = [Row("", "yes", GOOD_ROWS[0].image), GOOD_ROWS[0], Row("q?", "", GOOD_ROWS[0].image)]
    with pytest.raises(VQADataError) as caught:
        load_vqa("vqa-rad", "train", source=layout.write(tmp_path, "train", rows))
    assert [(row.row_index, row.problem) for row in caught.value.rows] == [(0, "empty question"), (2, "missing answer")]


def test_text_problems_are_reported_before_any_image_is_looked_up(layout: SourceLayout, tmp_path: Path) -> None:
    rows = [Row("", "yes", GOOD_ROWS[0].image), Row("is it?", "yes", None)]
    with pytest.raises(VQADataError) as caught:
        load_vqa(layout.dataset, layout.split, source=layout.write(tmp_path, layout.split, rows))
    assert [row.problem for row in caught.value.rows] == ["empty question"]


def test_unknown_split_lists_the_allowed_ones() -> None:
    with pytest.raises(VQADataError, match=r"unknown split 'dev'; allowed splits: train, test"):
        load_vqa("vqa-rad", "dev")


def test_unknown_dataset_lists_the_known_ones() -> None:
    with pytest.raises(VQADataError, match=r"unknown dataset 'vqa-med'; known datasets: easyvqa, easyvqa-stamped, gqa"):
        load_vqa("vqa-med", "train")


def test_split_absent_from_a_local_copy_names_the_splits_found(tmp_path: Path) -> None:
    layout = layout_of("pathvqa")
    source = layout.write(tmp_path, "validation", GOOD_ROWS)
    with pytest.raises(VQADataError, match=r"split 'test' is not in .* \(splits found: validation\)"):
        load_vqa("pathvqa", "test", source=source)


@pytest.mark.parametrize("dataset", ["vqa-rad", "okvqa", "vqav2"])
def test_missing_columns_are_named_with_the_columns_found(dataset: str, tmp_path: Path) -> None:
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "query": datasets.Value("string"), "answer": datasets.Value("string")}
    )
    image = {"bytes": png_bytes(Image.new("RGB", (2, 2))), "path": None}
    table = datasets.Dataset.from_dict({"image": [image], "query": ["q"], "answer": ["a"]}, features=features)
    datasets.DatasetDict({"train": table}).save_to_disk(tmp_path / "copy")
    with pytest.raises(VQADataError, match=r"lacks the columns .*question.*\(columns found: image, query, answer\)"):
        load_vqa(dataset, "train", source=str(tmp_path / "copy"))


@pytest.mark.parametrize("dataset", ["vqa-rad", "slake", "gqa", "vqav2"])
def test_uncached_hub_id_fails_fast_offline_with_how_to_supply_a_copy(dataset: str) -> None:
    split = get_adapter(dataset).splits[0]
    started = time.monotonic()
    with pytest.raises(VQADataError, match=r"not in the local Hugging Face cache.*source=<path>") as caught:
        load_vqa(dataset, split, source="qpriv-tests/never-published")
    assert time.monotonic() - started < 20
    assert caught.value.__cause__ is not None


def test_nonexistent_local_path_is_reported_as_such(tmp_path: Path) -> None:
    with pytest.raises(VQADataError, match="neither an existing path nor a hub id"):
        load_vqa("vqa-rad", "train", source=str(tmp_path / "missing"))


def test_limit_draws_a_seeded_subset_in_source_order() -> None:
    first = load_vqa("easyvqa", "test", limit=50, seed=1)
    again = load_vqa("easyvqa", "test", limit=50, seed=1)
    other = load_vqa("easyvqa", "test", limit=50, seed=2)
    assert [s.id for s in first] == [s.id for s in again]
    assert [s.id for s in first] != [s.id for s in other]
    assert [s.source_row for s in first] == sorted(s.source_row for s in first)
    assert len(first) == 50
    with pytest.raises(VQADataError, match="limit must be a positive"):
        load_vqa("easyvqa", "test", limit=0)


def test_question_containing_the_image_placeholder_is_rejected(tmp_path: Path) -> None:
    layout = layout_of("easyvqa")
    source = layout.write(tmp_path, "test", [Row("what is <image> showing?", "circle", GOOD_ROWS[0].image)])
    with pytest.raises(VQADataError, match=r"row 0 .*image placeholder"):
        load_vqa("easyvqa", "test", source=source)
