"""Frozen work in front of the decoder, computed once per image and reused.

The vision tower is frozen in every paradigm, so its patch features depend only on
the image. Computing them once per image id (not once per question or epoch) is
what makes CPU-sized runs feasible; a disk copy lets separate processes (Flower
deployment mode, resumed runs) share the work.
"""

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from vlm.loading import ImagePreprocessor
from vlm.segments import vision_features
from vqa import VQASample


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
            pixel_values = self.preprocess_images([sample.image for sample in batch])
            device = next(self.model.parameters()).device
            features = vision_features(self.model, pixel_values.to(device)).cpu()
            for sample, feature in zip(batch, features, strict=True):
                self._features[sample.image_id] = feature.clone()

    def stack(self, samples: Sequence[VQASample]) -> torch.Tensor:
        """[B, N, Dv] features for a batch of samples."""
        return torch.stack([self[sample.image_id] for sample in samples])

    def save(self, path: str | Path) -> None:
        torch.save(self._features, path)

    def load(self, path: str | Path) -> None:
        self._features.update(torch.load(path, weights_only=True))
