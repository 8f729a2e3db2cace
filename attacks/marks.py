"""Can the attacker read the burned-in ID back? The stamped benchmark's ground truth (vqa.stamping).

A `MarkReader` is the evaluator's probe: a logistic regression on the mark's box —
cropped, greyed to ink darkness and averaged down to the digit's 8×8 cells — trained
on stamped images the victims never had (the auxiliary split draws its digits from
handwriting disjoint from the training split's). Read-back is its accuracy on the
reconstructions, next to its accuracy on the originals (what a perfect attack would
read) and the most common digit's share (what a guess reads).
"""

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from torch.nn import functional as F

from vqa import VQASample, is_stamped, mark_records
from vqa.stamping import DIGIT_SIDE, MarkRecord

# ITU-R BT.601 luma: the ink is dark on light backgrounds.
_LUMA = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)


def mark_cells(images: torch.Tensor, marks: Sequence[MarkRecord]) -> np.ndarray:
    """[n, 64] ink darkness of each image's mark box, on the digit's 8×8 cells."""
    if images.shape[0] != len(marks):
        raise ValueError(f"got {images.shape[0]} images for {len(marks)} marks")
    side = images.shape[-1]
    cells = []
    for image, mark in zip(images, marks, strict=True):
        left, top, right, bottom = (round(edge * side / mark.image_side) for edge in mark.box)
        box = 1 - (image[None, :, top:bottom, left:right].float() * _LUMA).sum(1, keepdim=True)
        cells.append(F.adaptive_avg_pool2d(box, DIGIT_SIDE).flatten())
    return torch.stack(cells).numpy()


class MarkReader:
    def fit(self, images: torch.Tensor, marks: Sequence[MarkRecord]) -> "MarkReader":
        digits = [mark.digit for mark in marks]
        if len(set(digits)) < 2:
            raise ValueError(f"a mark reader needs stamped images of at least two digits, got {sorted(set(digits))}")
        self.classifier = LogisticRegression(max_iter=2000).fit(mark_cells(images, marks), digits)
        return self

    def read(self, images: torch.Tensor, marks: Sequence[MarkRecord]) -> np.ndarray:
        return self.classifier.predict(mark_cells(images, marks))


def mark_readback(
    reader: MarkReader, reconstructions: torch.Tensor, originals: torch.Tensor, marks: Sequence[MarkRecord]
) -> dict[str, float]:
    digits = np.array([mark.digit for mark in marks])
    return {
        "mark_readback": float((reader.read(reconstructions, marks) == digits).mean()),
        "mark_readback_originals": float((reader.read(originals, marks) == digits).mean()),
        "mark_readback_chance": Counter(digits.tolist()).most_common(1)[0][1] / len(digits),
        "marked_samples": float(len(digits)),
    }


def public_marks(samples: Sequence[VQASample]) -> list[MarkRecord | None]:
    """Each auxiliary image's mark, from its split's public records (None: a plain image)."""
    splits = {(s.dataset, s.split) for s in samples if is_stamped(s.dataset)}
    records = {split: mark_records(*split) for split in splits}
    return [records.get((s.dataset, s.split), {}).get(s.image_id) for s in samples]
