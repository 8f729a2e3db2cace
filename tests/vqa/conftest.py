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


# Privacy bags: the paper's positive (CelebA, NIH Chest X-ray, EuroSAT) and negative
# (MNIST, CIFAR-10) sets, each in the column layout of the hub copy the loader names.

BagPicture = Image.Image | bytes | None

GOOD_BAG_IMAGES: tuple[Image.Image, ...] = (
    Image.new("RGB", (21, 26), (180, 120, 90)),
    Image.new("L", (28, 28), 200),
    Image.new("RGBA", (9, 9), (0, 0, 255, 0)),
)

CELEBA_ATTRIBUTES = (
    "5_o_Clock_Shadow", "Arched_Eyebrows", "Attractive", "Bags_Under_Eyes", "Bald", "Bangs", "Big_Lips",
    "Big_Nose", "Black_Hair", "Blond_Hair", "Blurry", "Brown_Hair", "Bushy_Eyebrows", "Chubby",
    "Double_Chin", "Eyeglasses", "Goatee", "Gray_Hair", "Heavy_Makeup", "High_Cheekbones", "Male",
    "Mouth_Slightly_Open", "Mustache", "Narrow_Eyes", "No_Beard", "Oval_Face", "Pale_Skin", "Pointy_Nose",
    "Receding_Hairline", "Rosy_Cheeks", "Sideburns", "Smiling", "Straight_Hair", "Wavy_Hair",
    "Wearing_Earrings", "Wearing_Hat", "Wearing_Lipstick", "Wearing_Necklace", "Wearing_Necktie", "Young",
)


def _snapshot_readme(config: str, splits: Sequence[str], folder: str) -> str:
    data_files = "".join(f"  - split: {split}\n    path: {folder}/{split}-*\n" for split in splits)
    return f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{data_files}---\n"


def _write_snapshot(root: Path, config: str, folder: str, tables: dict[str, datasets.Dataset]) -> str:
    for split, table in tables.items():
        _to_parquet(table, root / folder / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(_snapshot_readme(config, list(tables), folder))
    return str(root)


def _celeba_table(images: Sequence[BagPicture]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "image": [_image_cell(image) for image in images],
            "celeb_id": [2880 + i for i in range(len(images))],
            **{name: [i % 2 == 0 for i in range(len(images))] for name in CELEBA_ATTRIBUTES},
        },
        features=_image_features(
            {"celeb_id": datasets.Value("int64"), **{name: datasets.Value("bool") for name in CELEBA_ATTRIBUTES}}
        ),
    )


def write_celeba(root: Path, split: str, images: Sequence[BagPicture]) -> str:
    """A flwrlabs/celeba snapshot: config img_align+identity+attr, splits train/valid/test."""
    tables = {name: _celeba_table(images if name == split else GOOD_BAG_IMAGES) for name in ("train", "valid", "test")}
    return _write_snapshot(root, "img_align+identity+attr", "img_align+identity+attr", tables)


def _nih_table(images: Sequence[BagPicture]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "image": [_image_cell(image) for image in images],
            "label": [["No Finding"] if i % 2 else ["Effusion", "Infiltration"] for i in range(len(images))],
            "Patient Age": [58 + i for i in range(len(images))],
            "Patient Gender": ["M" if i % 2 else "F" for i in range(len(images))],
            "View Position": ["PA"] * len(images),
            "Patient ID": [13 + i for i in range(len(images))],
        },
        features=_image_features(
            {
                "label": datasets.Sequence(datasets.Value("string")),
                "Patient Age": datasets.Value("int32"),
                "Patient Gender": datasets.Value("string"),
                "View Position": datasets.Value("string"),
                "Patient ID": datasets.Value("int32"),
            }
        ),
    )


def write_nih_chest_xray(root: Path, split: str, images: Sequence[BagPicture]) -> str:
    """A BahaaEldin0/NIH-Chest-Xray-14 snapshot: data/{train,valid,test}-*.parquet."""
    tables = {name: _nih_table(images if name == split else GOOD_BAG_IMAGES) for name in ("train", "valid", "test")}
    return _write_snapshot(root, "default", "data", tables)


EUROSAT_CLASSES = (
    "Annual Crop", "Forest", "Herbaceous Vegetation", "Highway", "Industrial Buildings",
    "Pasture", "Permanent Crop", "Residential Buildings", "River", "SeaLake",
)


def write_eurosat(root: Path, split: str, images: Sequence[BagPicture]) -> str:
    """One parquet data file of blanchon/EuroSAT_RGB (image, label, filename)."""
    table = datasets.Dataset.from_dict(
        {
            "image": [_image_cell(image) for image in images],
            "label": [i % len(EUROSAT_CLASSES) for i in range(len(images))],
            "filename": [f"Forest/Forest_{i + 1}.jpg" for i in range(len(images))],
        },
        features=_image_features(
            {"label": datasets.ClassLabel(names=list(EUROSAT_CLASSES)), "filename": datasets.Value("string")}
        ),
    )
    path = root / f"{split}-00000-of-00001.parquet"
    _to_parquet(table, path)
    return str(path)


def _digit_label_table(image_column: str, images: Sequence[BagPicture], classes: Sequence[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {image_column: [_image_cell(image) for image in images], "label": [i % len(classes) for i in range(len(images))]},
        features=datasets.Features({image_column: datasets.Image(), "label": datasets.ClassLabel(names=list(classes))}),
    )


def write_mnist(root: Path, split: str, images: Sequence[BagPicture]) -> str:
    """A save_to_disk copy of ylecun/mnist (image, label)."""
    table = _digit_label_table("image", images, [str(digit) for digit in range(10)])
    datasets.DatasetDict({split: table, "train": _digit_label_table("image", GOOD_BAG_IMAGES, ["0"])}).save_to_disk(
        root / "mnist"
    )
    return str(root / "mnist")


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def write_cifar10(root: Path, split: str, images: Sequence[BagPicture], image_column: str = "img") -> str:
    """A uoft-cs/cifar10 snapshot: config plain_text, plain_text/{train,test}-*.parquet (img, label)."""
    tables = {
        name: _digit_label_table(image_column, images if name == split else GOOD_BAG_IMAGES, CIFAR10_CLASSES)
        for name in ("train", "test")
    }
    return _write_snapshot(root, "plain_text", "plain_text", tables)


@dataclass(frozen=True)
class BagLayout:
    name: str
    # This package's split name; the writer is given the source's name for it.
    split: str
    source_split: str
    label: int
    write: Callable[[Path, str, Sequence[BagPicture]], str]

    def __str__(self) -> str:
        return self.name

    def written(self, root: Path, images: Sequence[BagPicture]) -> str:
        return self.write(root, self.source_split, images)


BAG_LAYOUTS = (
    BagLayout("celeba", "validation", "valid", 1, write_celeba),
    BagLayout("nih-chest-xray", "validation", "valid", 1, write_nih_chest_xray),
    BagLayout("eurosat", "test", "test", 1, write_eurosat),
    BagLayout("mnist", "test", "test", 0, write_mnist),
    BagLayout("cifar10", "train", "train", 0, write_cifar10),
)


@pytest.fixture(params=BAG_LAYOUTS, ids=str)
def bag_layout(request: pytest.FixtureRequest) -> BagLayout:
    return request.param
