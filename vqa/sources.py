"""Opening Hugging Face data from a hub id or from a local copy, without surprises.

One code path for every HF-backed adapter: a local path (saved dataset, hub snapshot
directory, or data files) is loaded as it is; a hub id is looked up in the local
cache first with downloads forced off, so an offline machine fails at once with
instructions instead of hanging on network retries.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import datasets
from huggingface_hub import constants as hub_constants

from vqa.errors import VQADataError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DATA_FILE_BUILDERS = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".arrow": "arrow",
}
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}

T = TypeVar("T")


def downloads_disabled() -> bool:
    """Whether the user asked for offline mode (read now, not only at import)."""
    from_env = any(
        os.environ.get(variable, "").upper() in _TRUE_VALUES
        for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    return from_env or bool(datasets.config.HF_HUB_OFFLINE)


@contextmanager
def _hub_offline() -> Iterator[None]:
    # Both libraries read these module flags at call time; not thread-safe by nature.
    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _not_cached_message(hub_id: str) -> str:
    return (
        f"hub dataset {hub_id!r} is not in the local Hugging Face cache and downloads are off "
        "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE). Supply a local copy with source=<path>: a "
        "directory written by DatasetDict.save_to_disk, a snapshot directory "
        f"(huggingface-cli download {hub_id} --repo-type dataset --local-dir <dir>), or a data "
        "file (.parquet, .json, .jsonl, .csv, .arrow). If you meant a local path, it does not exist"
    )


def from_hub_cache_first(dataset: str, split: str, hub_id: str, fetch: Callable[[], T]) -> T:
    """``fetch()`` from the cache only; then, unless offline was asked for, from the hub."""
    try:
        with _hub_offline():
            return fetch()
    except Exception as cache_miss:  # every library flavour of "not cached"
        if downloads_disabled():
            raise VQADataError(_not_cached_message(hub_id), dataset=dataset, split=split) from cache_miss
    try:
        return fetch()
    except Exception as err:
        raise VQADataError(
            f"could not download hub dataset {hub_id!r}: {err}. {_not_cached_message(hub_id)}",
            dataset=dataset,
            split=split,
        ) from err


def is_hub_id(source: str) -> bool:
    return not Path(source).exists() and _HUB_ID.fullmatch(source) is not None


def is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def require_local_path(dataset: str, source: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise VQADataError(f"source {source!r} is neither an existing path nor a hub id", dataset=dataset)
    return path


def open_hf_split(
    dataset: str, source: str, split: str, *, config: str | None = None
) -> datasets.Dataset:
    """One split of ``source`` as a ``datasets.Dataset``.

    ``config`` names the hub configuration and is used for hub ids and snapshot
    directories only; saved datasets and data files have none.
    """
    if is_hub_id(source):
        return from_hub_cache_first(
            dataset, split, source, lambda: datasets.load_dataset(source, config, split=split)
        )
    path = require_local_path(dataset, source)
    try:
        if is_saved_dataset(path):
            return _saved_split(dataset, path, split)
        if path.is_file():
            builder = _DATA_FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                known = ", ".join(sorted(_DATA_FILE_BUILDERS))
                raise VQADataError(
                    f"cannot read {path.name!r}: data files must end in one of {known}",
                    dataset=dataset,
                    split=split,
                )
            return datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        return datasets.load_dataset(str(path), config, split=split)
    except VQADataError:
        raise
    except Exception as err:  # datasets/pyarrow raise many types; the cause stays chained
        raise VQADataError(f"could not read source {source!r}: {err}", dataset=dataset, split=split) from err


def _saved_split(dataset: str, path: Path, split: str) -> datasets.Dataset:
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.Dataset):
        raise VQADataError(
            f"{path} holds a single saved Dataset without split names; save a DatasetDict "
            f"({{{split!r}: dataset, ...}}) so the split is explicit",
            dataset=dataset,
            split=split,
        )
    if split not in loaded:
        raise VQADataError(
            f"split {split!r} is not in {path} (splits found: {', '.join(loaded)})",
            dataset=dataset,
            split=split,
        )
    return loaded[split]


def require_columns(
    dataset: str, split: str, table: datasets.Dataset, columns: tuple[str, ...], source: str
) -> None:
    missing = [column for column in columns if column not in table.column_names]
    if missing:
        raise VQADataError(
            f"source {source!r} lacks the columns {', '.join(missing)} "
            f"(columns found: {', '.join(table.column_names)})",
            dataset=dataset,
            split=split,
        )
