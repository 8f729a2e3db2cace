"""Draw a few stamped easy-VQA images with their mark patches outlined (the figure of docs/models.md).

    python scripts/stamped_examples.py [--out results/stamped_examples.png] [--split test]

One stamped image per corner; the top row outlines the mark patches on the mini
model's grid (64 px, patch 8 -> 8x8), the bottom row on a DINOv2-S/14 grid (224 px,
patch 14 -> 16x16), each computed by ``vqa.mark_patches``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the headless backend is chosen)
from matplotlib.patches import Rectangle  # noqa: E402

from vqa import load_vqa, mark_patches, mark_records  # noqa: E402
from vqa.stamping import MARK_POSITIONS  # noqa: E402

DATASET = "easyvqa-stamped"
GRIDS = ((64, 8, "mini grid (64 px, patch 8)"), (224, 14, "DINOv2-S/14 grid (224 px, patch 14)"))


def save_stamped_examples(out: Path, split: str = "test") -> Path:
    marks = mark_records(DATASET, split)
    first_sample = {sample.image_id: sample for sample in reversed(load_vqa(DATASET, split))}
    examples = [
        next(mark for image_id, mark in sorted(marks.items()) if mark.position == position and image_id in first_sample)
        for position in MARK_POSITIONS
    ]
    figure, axes = plt.subplots(len(GRIDS), len(examples), figsize=(3 * len(examples), 3.3 * len(GRIDS)))
    for column, mark in enumerate(examples):
        sample = first_sample[mark.image_id]
        for row, (image_size, patch_size, grid_name) in enumerate(GRIDS):
            axis = axes[row][column]
            axis.imshow(sample.image.resize((image_size, image_size)), extent=(0, image_size, image_size, 0))
            grid = image_size // patch_size
            for patch in mark_patches(mark, image_size, patch_size):
                top, left = divmod(patch, grid)
                axis.add_patch(
                    Rectangle(
                        (left * patch_size, top * patch_size), patch_size, patch_size, fill=False, edgecolor="red"
                    )
                )
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(f"digit {mark.digit}, {mark.position}\n{mark.image_id}", fontsize=8)
            if column == 0:
                axis.set_ylabel(grid_name, fontsize=8)
    figure.suptitle(f"{DATASET}/{split}: the burned-in digit and the patches that hold it (red)", fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/stamped_examples.png"))
    parser.add_argument("--split", default="test", choices=("train", "test"))
    arguments = parser.parse_args()
    print(save_stamped_examples(arguments.out, arguments.split))


if __name__ == "__main__":
    main()
