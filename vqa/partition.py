"""Splitting one dataset across federated clients with flwr-datasets partitioners.

The partitioner sees one row per *group* (by default: per image), never per
question, so all questions about one image land on the same client: otherwise
client shards would share images and leak them across clients. Each group row
carries a label (the most common ``label_by`` value among its questions) that the
label-skewed partitioners split on. Partitions are disjoint, and every sample is in
exactly one of them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import datasets
import numpy as np
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner

from vqa.schema import VQADataset, VQASample

_SAMPLE_FIELDS = frozenset(field.name for field in fields(VQASample))


@dataclass(frozen=True)
class PartitionSettings:
    num_partitions: int
    seed: int
    alpha: float
    min_partition_size: int


PartitionerFactory = Callable[[PartitionSettings], Partitioner]


def _iid(settings: PartitionSettings) -> Partitioner:
    # IidPartitioner cuts contiguous shards; the seeded shuffle happens on the group table.
    return IidPartitioner(num_partitions=settings.num_partitions)


def _dirichlet(settings: PartitionSettings) -> Partitioner:
    if not (math.isfinite(settings.alpha) and settings.alpha > 0):
        raise ValueError(f"Dirichlet alpha must be a positive finite number, got {settings.alpha}")
    return DirichletPartitioner(
        num_partitions=settings.num_partitions,
        partition_by="label",
        alpha=settings.alpha,
        min_partition_size=settings.min_partition_size,
        self_balancing=False,
        shuffle=True,
        seed=settings.seed,
    )


PARTITIONERS: dict[str, PartitionerFactory] = {"iid": _iid, "dirichlet": _dirichlet}


def register_partitioner(name: str, factory: PartitionerFactory) -> None:
    """Add a flwr-datasets partitioner; it is given a table with ``group_row`` and ``label``."""
    if name in PARTITIONERS:
        raise ValueError(f"partitioner {name!r} is already registered")
    PARTITIONERS[name] = factory


def partition_indices(
    samples: Sequence[VQASample],
    num_partitions: int,
    *,
    method: str = "iid",
    seed: int = 0,
    alpha: float = 0.5,
    group_by: str | None = "image_id",
    label_by: str = "answer",
    min_partition_size: int = 1,
) -> list[list[int]]:
    """Sample indices of each client's shard, in source order.

    ``group_by`` names the sample field whose equal values must stay together
    (None: every sample is its own group). ``min_partition_size`` counts groups and
    only constrains Dirichlet, which redraws (up to flwr's retry limit) until it holds.
    """
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partition method {method!r}; known: {', '.join(sorted(PARTITIONERS))}")
    for role, name in (("group_by", group_by), ("label_by", label_by)):
        if name is not None and name not in _SAMPLE_FIELDS:
            raise ValueError(f"{role}={name!r} is not a sample field; fields: {', '.join(sorted(_SAMPLE_FIELDS))}")
    groups = _group_members(samples, group_by)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    if num_partitions > len(groups):
        unit = "samples" if group_by is None else f"distinct {group_by} groups"
        raise ValueError(f"cannot split {len(groups)} {unit} into {num_partitions} partitions")
    settings = PartitionSettings(num_partitions, seed, alpha, min_partition_size)
    partitioner = PARTITIONERS[method](settings)
    partitioner.dataset = _group_table(samples, groups, label_by, seed)
    try:
        shards = [partitioner.load_partition(client)["group_row"] for client in range(num_partitions)]
    except ValueError as err:
        raise ValueError(
            f"{method} partitioning into {num_partitions} partitions failed ({err}); raise alpha, "
            f"lower min_partition_size (it counts {group_by or 'sample'} groups), or use fewer partitions"
        ) from err
    return [sorted(index for group_row in shard for index in groups[group_row]) for shard in shards]


def partition_dataset(
    dataset: VQADataset,
    num_partitions: int,
    *,
    method: str = "iid",
    seed: int = 0,
    alpha: float = 0.5,
    group_by: str | None = "image_id",
    label_by: str = "answer",
    min_partition_size: int = 1,
) -> list[VQADataset]:
    """One ``VQADataset`` per client; see ``partition_indices``."""
    shards = partition_indices(
        dataset,
        num_partitions,
        method=method,
        seed=seed,
        alpha=alpha,
        group_by=group_by,
        label_by=label_by,
        min_partition_size=min_partition_size,
    )
    return [dataset.select(shard) for shard in shards]


def _group_members(samples: Sequence[VQASample], group_by: str | None) -> list[list[int]]:
    if group_by is None:
        return [[index] for index in range(len(samples))]
    members: dict[object, list[int]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(getattr(sample, group_by), []).append(index)
    return list(members.values())


def _group_table(
    samples: Sequence[VQASample], groups: list[list[int]], label_by: str, seed: int
) -> datasets.Dataset:
    order = np.random.default_rng(seed).permutation(len(groups))
    labels = [
        # most_common keeps first-seen order among ties: deterministic labels.
        str(Counter(getattr(samples[index], label_by) for index in groups[group_row]).most_common(1)[0][0])
        for group_row in order
    ]
    return datasets.Dataset.from_dict({"group_row": [int(row) for row in order], "label": labels})
