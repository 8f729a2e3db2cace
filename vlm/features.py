"""Frozen work in front of the decoder, computed once per image and reused.

The vision tower is frozen in every paradigm, so its patch features depend only on
the image. Computing them once per image id (not once per question or epoch) is
what makes CPU-sized runs feasible; a disk copy lets separate processes (Flower
deployment mode, resumed runs) share the work.
"""

import logging
import os
import pickle
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from vlm.loading import ImagePreprocessor
from vlm.segments import vision_features
from vqa import VQASample

log = logging.getLogger(__name__)


def write_cache(data: Any, path: str | Path) -> None:
    """`data` (tensors in containers) at `path`, never torn: written beside it, then moved over it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    torch.save(data, partial)
    os.replace(partial, path)


def read_cache(path: str | Path) -> Any | None:
    """What write_cache left at `path`; None, with a warning naming the file, when it is missing or
    unreadable (torn by a kill mid-write under an older build, or damaged): a cache is rebuilt,
    never fatal and never used half."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        log.warning("cache %s is unreadable (%s: %s); recomputing it", path, type(error).__name__, error)
        return None


class VisionFeatureCache:
    """Patch features [N, Dv] per image id at the model's vision feature layer."""

    def __init__(self, model: nn.Module, preprocess_images: ImagePreprocessor, *, batch_size: int = 256) -> None:
        self.model = model
        self.preprocess_images = preprocess_images
        self.batch_size = batch_size
        self._features: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._features)

    def __contains__(self, image_id: str) -> bool:
        return image_id in self._features

    def __getitem__(self, image_id: str) -> torch.Tensor:
        try:
            return self._features[image_id]
        except KeyError:
            raise KeyError(f"no cached vision features for image id {image_id!r}; call add() first") from None

    @torch.no_grad()
    def add(self, samples: Iterable[VQASample], *, progress: bool = True) -> None:
        """Encode every image among `samples` not cached yet, once per image id."""
        pending: dict[str, VQASample] = {}
        for sample in samples:
            if sample.image_id not in self._features:
                pending.setdefault(sample.image_id, sample)
        todo = list(pending.values())
        for start in tqdm(
            range(0, len(todo), self.batch_size), desc="vision features", unit="batch", disable=not progress
        ):
            batch = todo[start : start + self.batch_size]
            pixel_values = self.sample_pixel_values(batch)
            device = next(self.model.parameters()).device
            features = vision_features(self.model, pixel_values.to(device)).cpu()
            for sample, feature in zip(batch, features, strict=True):
                self._features[sample.image_id] = feature.clone()

    def sample_pixel_values(self, samples: Sequence[VQASample]) -> torch.Tensor:
        """The model's input pixels [B, 3, H, W] for samples' images."""
        return self.preprocess_images([sample.image for sample in samples])

    def stack(self, samples: Sequence[VQASample]) -> torch.Tensor:
        """[B, N, Dv] features for a batch of samples."""
        return torch.stack([self[sample.image_id] for sample in samples])

    def save(self, path: str | Path) -> None:
        write_cache(self._features, path)

    def load(self, path: str | Path) -> None:
        """The features saved at `path`, if it holds a readable cache (read_cache)."""
        self._features.update(read_cache(path) or {})
