"""Local, generated copies of every source layout, so no test touches the network.

Each writer reproduces the column layout and answer conventions of the copy a user
would download (hub parquet snapshot, ``save_to_disk`` directory, data file, or the
original SLAKE/easy-VQA folders) and returns the ``source`` a user would pass.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
from PIL import Image


@pytest.fixture(autouse=True)
def offline_and_private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads off and the datasets cache under tmp, so tests can neither fetch nor litter."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-cache"))


@dataclass(frozen=True)
class Row:
    """A source-neutral row; ``image`` is a picture, raw (possibly corrupt) bytes, or None."""

    question: str | None
    answer: str | None
    image: Image.Image | bytes | None


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _encoded(image: Image.Image | bytes | None) -> bytes | None:
    return png_bytes(image) if isinstance(image, Image.Image) else image


def _image_cell(image: Image.Image | bytes | None) -> dict[str, object] | None:
    data = _encoded(image)
    return None if data is None else {"bytes": data, "path": None}


GOOD_ROWS = (
    Row("Is there a fracture?", "Yes", Image.new("RGB", (40, 30), (200, 10, 10))),
    Row("Which organ is shown?", "Left  Lung", Image.new("L", (33, 17), 90)),
    Row("where is the lesion?", "liver", Image.new("RGBA", (8, 8), (0, 0, 255, 0))),
)
EXPECTED_ANSWERS = ("yes", "left lung", "liver")


def _to_parquet(table: datasets.Dataset, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(path)


def _image_features(extra: dict[str, datasets.features.FeatureType]) -> datasets.Features:
    return datasets.Features({**extra, "image": datasets.Image()})


def _single_answer_table(rows: Sequence[Row]) -> datasets.Dataset:
    """flaviagiammarino/vqa-rad and path-vqa: image, question, answer."""
    return datasets.Dataset.from_dict(
        {
            "image": [_image_cell(row.image) for row in rows],
            "question": [row.question for row in rows],
            "answer": [row.answer for row in rows],
        },
        features=_image_features({"question": datasets.Value("string"), "answer": datasets.Value("string")}),
    )


def write_vqa_rad(root: Path, split: str, rows: Sequence[Row]) -> str:
    """A hub snapshot directory: data/{split}-00000-of-00001.parquet for train and test."""
    for written_split in ("train", "test"):
        table = _single_answer_table(rows if written_split == split else GOOD_ROWS)
        _to_parquet(table, root / "data" / f"{written_split}-00000-of-00001.parquet")
    return str(root)


def write_pathvqa(root: Path, split: str, rows: Sequence[Row]) -> str:
    """A directory written by DatasetDict.save_to_disk."""
    datasets.DatasetDict({split: _single_answer_table(rows)}).save_to_disk(root / "saved")
    return str(root / "saved")


def _human_answers(answer: str | None, with_raw: bool) -> list[dict[str, object]]:
    if answer is None:
        return []
    given = [answer] * 6 + ["something else"] * 4
    return [
        {"answer": text, **({"raw_answer": text} if with_raw else {}), "answer_confidence": "yes", "answer_id": i + 1}
        for i, text in enumerate(given)
    ]


def write_okvqa(root: Path, split: str, rows: Sequence[Row]) -> str:
    """A single parquet data file with HuggingFaceM4/OK-VQA's columns."""
    table = datasets.Dataset.from_dict(
        {
            "image": [_image_cell(row.image) for row in rows],
            "question_type": ["one"] * len(rows),
            "confidence": [3] * len(rows),
            "answers": [_human_answers(row.answer, with_raw=True) for row in rows],
            "question_id": [2971475 + 10 * i for i in range(len(rows))],
            "question": [row.question for row in rows],
        },
        features=_image_features(
            {
                "question_type": datasets.Value("string"),
                "confidence": datasets.Value("int32"),
                "answers": [
                    {
                        "answer": datasets.Value("string"),
                        "raw_answer": datasets.Value("string"),
                        "answer_confidence": datasets.Value("string"),
                        "answer_id": datasets.Value("int64"),
                    }
                ],
                "question_id": datasets.Value("int64"),
                "question": datasets.Value("string"),
            }
        ),
    )
    path = root / f"okvqa-{split}.parquet"
    _to_parquet(table, path)
    return str(path)


def write_vqav2(root: Path, split: str, rows: Sequence[Row]) -> str:
    """A save_to_disk directory with HuggingFaceM4/VQAv2's columns."""
    answer_types = ["yes/no" if (row.answer or "").lower() in {"yes", "no"} else "other" for row in rows]
    table = datasets.Dataset.from_dict(
        {
            "question_type": ["is there a" if kind == "yes/no" else "what" for kind in answer_types],
            "multiple_choice_answer": [row.answer for row in rows],
            "answers": [_human_answers(row.answer, with_raw=False) for row in rows],
            "image_id": [9000 + i for i in range(len(rows))],
            "answer_type": answer_types,
            "question_id": [9000000 + i for i in range(len(rows))],
            "question": [row.question for row in rows],
            "image": [_image_cell(row.image) for row in rows],
        },
        features=_image_features(
            {
                "question_type": datasets.Value("string"),
                "multiple_choice_answer": datasets.Value("string"),
                "answers": [
                    {
                        "answer": datasets.Value("string"),
                        "answer_confidence": datasets.Value("string"),
                        "answer_id": datasets.Value("int64"),
                    }
                ],
                "image_id": datasets.Value("int64"),
                "answer_type": datasets.Value("string"),
                "question_id": datasets.Value("int64"),
                "question": datasets.Value("string"),
            }
        ),
    )
    datasets.DatasetDict({split: table}).save_to_disk(root / "vqav2")
    return str(root / "vqav2")


_GQA_README = """---
configs:
- config_name: {split}_balanced_instructions
  data_files:
  - split: {split}
    path: {split}_balanced_instructions/{split}-*
- config_name: {split}_balanced_images
  data_files:
  - split: {split}
    path: {split}_balanced_images/{split}-*
---
"""


def write_gqa(root: Path, split: str, rows: Sequence[Row]) -> str:
    """An lmms-lab/GQA snapshot: instructions and images as two configurations keyed by imageId."""
    image_ids = [f"n{161313 + i}" for i in range(len(rows))]
    kinds = ["verify" if (row.answer or "").lower() in {"yes", "no"} else "query" for row in rows]
    instructions = datasets.Dataset.from_dict(
        {
            "id": [str(201307251 + i) for i in range(len(rows))],
            "imageId": image_ids,
            "question": [row.question for row in rows],
            "answer": [row.answer for row in rows],
            "fullAnswer": [f"The answer is {row.answer}." for row in rows],
            "isBalanced": [True] * len(rows),
            "types": [{"structural": kind, "semantic": "rel", "detailed": "place"} for kind in kinds],
        }
    )
    with_images = [(key, row.image) for key, row in zip(image_ids, rows) if row.image is not None]
    images = datasets.Dataset.from_dict(
        {"id": [key for key, _ in with_images], "image": [_image_cell(image) for _, image in with_images]},
        features=_image_features({"id": datasets.Value("string")}),
    )
    _to_parquet(instructions, root / f"{split}_balanced_instructions" / f"{split}-00000-of-00001.parquet")
    _to_parquet(images, root / f"{split}_balanced_images" / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(_GQA_README.format(split=split))
    return str(root)


_SLAKE_SPLIT_FILES = {"train": "train.json", "validation": "validate.json", "test": "test.json"}


def write_slake(root: Path, split: str, rows: Sequence[Row]) -> str:
    """The original SLAKE folder: {split}.json plus imgs/xmlab{n}/source.jpg; a Chinese twin per row."""
    records = []
    for index, row in enumerate(rows):
        image_name = f"xmlab{index}/source.jpg"
        data = _encoded(row.image)
        if data is not None:
            path = root / "imgs" / image_name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        closed = (row.answer or "").lower() in {"yes", "no"}
        common = {
            "img_id": index,
            "img_name": image_name,
            "location": "Abdomen",
            "modality": "CT",
            "answer_type": "CLOSED" if closed else "OPEN",
            "base_type": "vqa",
            "content_type": "Abnormality" if closed else "Organ",
            "triple": ["vhead", "_", "_"],
        }
        records.append({**common, "qid": 2 * index, "question": row.question, "answer": row.answer, "q_lang": "en"})
        chinese = {"qid": 2 * index + 1, "question": "图中是什么器官?", "answer": "肝脏", "q_lang": "zh"}
        records.append({**common, **chinese})
    (root / "imgs").mkdir(exist_ok=True)
    (root / _SLAKE_SPLIT_FILES[split]).write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return str(root)


def write_easyvqa(root: Path, split: str, rows: Sequence[Row]) -> str:
    """The easy-vqa package's data folder layout: {split}/questions.json and {split}/images/{id}.png."""
    images_dir = root / split / "images"
    images_dir.mkdir(parents=True)
    for index, row in enumerate(rows):
        data = _encoded(row.image)
        if data is not None:
            (images_dir / f"{index}.png").write_bytes(data)
    triples = [[row.question, row.answer, index] for index, row in enumerate(rows)]
    (root / split / "questions.json").write_text(json.dumps(triples))
    return str(root)


@dataclass(frozen=True)
class SourceLayout:
    dataset: str
    split: str
    write: Callable[[Path, str, Sequence[Row]], str]
    # Row index the loader reports for the n-th written row (SLAKE interleaves zh rows).
    row_stride: int = 1

    def __str__(self) -> str:
        return self.dataset


LAYOUTS = (
    SourceLayout("vqa-rad", "train", write_vqa_rad),
    SourceLayout("pathvqa", "validation", write_pathvqa),
    SourceLayout("slake", "validation", write_slake, row_stride=2),
    SourceLayout("gqa", "testdev", write_gqa),
    SourceLayout("okvqa", "validation", write_okvqa),
    SourceLayout("vqav2", "validation", write_vqav2),
    SourceLayout("easyvqa", "test", write_easyvqa),
)


def layout_of(dataset: str) -> SourceLayout:
    return next(layout for layout in LAYOUTS if layout.dataset == dataset)


@pytest.fixture(params=LAYOUTS, ids=str)
def layout(request: pytest.FixtureRequest) -> SourceLayout:
    return request.param
