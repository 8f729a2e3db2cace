from __future__ import annotations

import itertools

import numpy as np
import pytest
from PIL import Image

from vqa import VQADataset, load_vqa, partition_dataset, partition_indices
from vqa.images import InMemoryImage
from vqa.schema import VQASample

_PIXEL = InMemoryImage(Image.new("RGB", (1, 1)))
LABELS = ("yes", "no", "red", "blue", "circle")


def synthetic(num_images: int = 200, questions_per_image: int = 3) -> VQADataset:
    """Images with a few questions each; an image's questions share its label."""
    samples = [
        VQASample(
            id=f"{image}-{question}",
            dataset="synthetic",
            split="train",
            question="q?",
            answer=LABELS[image % len(LABELS)],
            answer_type="closed",
            question_kind="k",
            image_id=str(image),
            source_row=image * questions_per_image + question,
            image_ref=_PIXEL,
        )
        for image in range(num_images)
        for question in range(questions_per_image)
    ]
    return VQADataset("synthetic", "train", samples)


def _assert_disjoint_and_complete(shards: list[list[int]], size: int) -> None:
    flat = [index for shard in shards for index in shard]
    assert len(flat) == len(set(flat)) == size


@pytest.mark.parametrize("method", ["iid", "dirichlet"])
def test_shards_are_disjoint_cover_everything_and_keep_images_together(method: str) -> None:
    samples = synthetic()
    shards = partition_indices(samples, 4, method=method, seed=3, alpha=1.0)
    _assert_disjoint_and_complete(shards, len(samples))
    image_owner = {}
    for client, shard in enumerate(shards):
        for index in shard:
            assert image_owner.setdefault(samples[index].image_id, client) == client


@pytest.mark.parametrize("method", ["iid", "dirichlet"])
def test_same_seed_same_shards_other_seed_other_shards(method: str) -> None:
    samples = synthetic()
    first = partition_indices(samples, 4, method=method, seed=7, alpha=1.0)
    assert partition_indices(samples, 4, method=method, seed=7, alpha=1.0) == first
    assert partition_indices(samples, 4, method=method, seed=8, alpha=1.0) != first


def test_iid_shards_are_balanced_in_groups() -> None:
    shards = partition_indices(synthetic(num_images=200), 4)
    assert [len(shard) for shard in shards] == [150] * 4


def test_ungrouped_partition_splits_questions_of_one_image() -> None:
    samples = synthetic(num_images=10, questions_per_image=10)
    shards = partition_indices(samples, 5, group_by=None, seed=0)
    _assert_disjoint_and_complete(shards, len(samples))
    owners_of_image_0 = {client for client, shard in enumerate(shards) for i in shard if samples[i].image_id == "0"}
    assert len(owners_of_image_0) > 1


def _label_skew(samples: VQADataset, shards: list[list[int]]) -> float:
    """Mean total-variation distance between each client's label mix and the global one."""
    global_mix = np.array([sum(s.answer == label for s in samples) for label in LABELS], dtype=float)
    global_mix /= global_mix.sum()
    distances = []
    for shard in shards:
        mix = np.array([sum(samples[i].answer == label for i in shard) for label in LABELS], dtype=float)
        distances.append(0.5 * np.abs(mix / mix.sum() - global_mix).sum())
    return float(np.mean(distances))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    samples = synthetic(num_images=500, questions_per_image=1)
    skews = [
        np.mean(
            [
                _label_skew(samples, partition_indices(samples, 5, method="dirichlet", alpha=alpha, seed=seed))
                for seed in range(3)
            ]
        )
        for alpha in (100.0, 1.0, 0.1)
    ]
    assert skews[0] < 0.1 < skews[1] < skews[2]


def test_easyvqa_partitions_by_image_as_datasets() -> None:
    samples = load_vqa("easyvqa", "test")
    shards = partition_dataset(samples, 3, method="dirichlet", alpha=0.5, seed=0)
    assert sum(len(shard) for shard in shards) == len(samples)
    images = [{s.image_id for s in shard} for shard in shards]
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(images, 2))
    assert {shard.name for shard in shards} == {"easyvqa"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_partitions": 0}, "num_partitions must be a positive integer"),
        ({"num_partitions": 2.5}, "num_partitions must be a positive integer"),
        ({"num_partitions": 11}, "cannot split 10 distinct image_id groups into 11 partitions"),
        ({"num_partitions": 2, "method": "dirichlet", "alpha": 0.0}, "alpha must be a positive finite number"),
        ({"num_partitions": 2, "method": "dirichlet", "alpha": float("nan")}, "alpha must be a positive finite"),
        ({"num_partitions": 2, "method": "shards"}, "unknown partition method 'shards'; known: dirichlet, iid"),
        ({"num_partitions": 2, "group_by": "patient"}, "group_by='patient' is not a sample field"),
    ],
)
def test_bad_settings_are_explained(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_indices(synthetic(num_images=10), **options)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:The specified min_partition_size:UserWarning")
def test_unreachable_min_partition_size_is_explained() -> None:
    with pytest.raises(ValueError, match=r"dirichlet partitioning into 5 partitions failed .*lower min_partition_size"):
        partition_indices(synthetic(num_images=20), 5, method="dirichlet", alpha=0.01, min_partition_size=4)
