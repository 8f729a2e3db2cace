"""QPriv-VL's frozen per-sample inputs, computed once and reused.

DINOv2 patch features depend only on the image and the question vector only on the
question text, and both encoders are frozen: like vlm.features.VisionFeatureCache,
each is computed once per image id / question text and can be saved for other
processes. A saved cache records its encoders' fingerprint and refuses to load into
a cache of other encoders.
"""

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from tqdm.auto import tqdm

from pruning.encoders import FrozenEncoders
from vlm.features import read_cache, write_cache
from vqa import VQASample


class PruningInputCache:
    """DINOv2 patch features [Nd, Dd] per image id and CLIP text vectors [Dt] per question text."""

    def __init__(self, encoders: FrozenEncoders, *, batch_size: int = 64) -> None:
        self.encoders = encoders
        self.batch_size = batch_size
        self._patches: dict[str, torch.Tensor] = {}
        self._questions: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, samples: Iterable[VQASample], *, progress: bool = False) -> None:
        """Encode every image and question among `samples` not cached yet, once each."""
        images: dict[str, VQASample] = {}
        questions: set[str] = set()
        for sample in samples:
            if sample.image_id not in self._patches:
                images.setdefault(sample.image_id, sample)
            if sample.question not in self._questions:
                questions.add(sample.question)
        image_todo, question_todo = list(images.values()), sorted(questions)
        for start in tqdm(
            range(0, len(image_todo), self.batch_size), desc="DINOv2 patches", unit="batch", disable=not progress
        ):
            batch = image_todo[start : start + self.batch_size]
            features = self.encoders.encode_images([sample.image for sample in batch]).cpu()
            for sample, feature in zip(batch, features, strict=True):
                self._patches[sample.image_id] = feature.clone()
        for start in tqdm(
            range(0, len(question_todo), self.batch_size), desc="question vectors", unit="batch", disable=not progress
        ):
            batch = question_todo[start : start + self.batch_size]
            for question, vector in zip(batch, self.encoders.encode_questions(batch).cpu(), strict=True):
                self._questions[question] = vector.clone()

    def dino_patches(self, samples: Sequence[VQASample]) -> torch.Tensor:
        """[B, Nd, Dd] for a batch of samples."""
        try:
            return torch.stack([self._patches[sample.image_id] for sample in samples])
        except KeyError as error:
            raise KeyError(f"no cached DINOv2 patches for image id {error.args[0]!r}; call add() first") from None

    def question_vectors(self, samples: Sequence[VQASample]) -> torch.Tensor:
        """[B, Dt] for a batch of samples."""
        try:
            return torch.stack([self._questions[sample.question] for sample in samples])
        except KeyError as error:
            raise KeyError(f"no cached question vector for {error.args[0]!r}; call add() first") from None

    def save(self, path: str | Path) -> None:
        write_cache({"encoders": self.encoders.fingerprint, "patches": self._patches, "questions": self._questions}, path)

    def load(self, path: str | Path) -> None:
        """The inputs saved at `path`, if it holds a readable cache (read_cache) of these encoders."""
        saved = read_cache(path)
        if saved is None:
            return
        if saved["encoders"] != self.encoders.fingerprint:
            raise ValueError(
                f"{path} was computed by encoders {saved['encoders']}, not by these ({self.encoders.fingerprint}); "
                "delete it to recompute"
            )
        self._patches.update(saved["patches"])
        self._questions.update(saved["questions"])
