"""How much of its patch position each visual token's row carries (seed 002, Fig. 2 bottom).

SARA (attacks/sara.py) can undo shuffling only if a row, read on its own, says where its
patch was. These probes measure that: a classifier reads the patch index (one of N) from a
single row, trained on some images and scored on others, at each place a row can be read —
the vision tower after its embeddings and after each layer up to the feature layer LLaVA
reads, and the decoder rows a front sends at its first cut. At the cut a row's slot in the
sequence (its rotary position) would give the order away, so the cut is probed twice: rows
sent in patch order, and rows sent in a random order per image (the shuffled edge), where
only what the row itself carries can tell its patch.

Two probes per place, as in the paper: a linear one (multinomial logistic regression) and a
one-hidden-layer MLP, both scikit-learn, on standardised rows. Accuracy is top-1 over the N
positions on held-out images; chance is 1/N.
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from tqdm.auto import tqdm

from attacks.knowledge import AttackerKnowledge, visual_rows
from vlm.segments import vision_hidden_states
from vqa import VQASample

PROBES = ("linear", "mlp")


@dataclass
class PositionProbeOptions:
    # Share of the images whose rows only score the probes (never train them).
    test_share: float = 0.25
    probes: tuple[str, ...] = PROBES
    # The MLP's hidden width, and both probes' iteration caps (the MLP stops early on a
    # held-out tenth of its training rows).
    mlp_width: int = 256
    max_iter: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.test_share < 1:
            raise ValueError(f"test_share={self.test_share} must be in (0, 1)")
        unknown = [p for p in self.probes if p not in PROBES]
        if unknown or not self.probes:
            raise ValueError(f"probes={self.probes!r}; allowed: a non-empty subset of {PROBES}")
        for name in ("mlp_width", "max_iter"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


@dataclass
class PlaceProbe:
    """The probes' held-out accuracy at one place a row can be read."""

    place: str
    kind: str  # "vision" or "cut"
    layer: int
    order: str  # "patch" or "shuffled"
    width: int
    accuracy: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def distinct_images(samples: Sequence[VQASample]) -> list[VQASample]:
    """One sample per image id, in first-seen order (a probe's rows are per image, not per question)."""
    seen: dict[str, VQASample] = {}
    for sample in samples:
        seen.setdefault(sample.image_id, sample)
    return list(seen.values())


@torch.no_grad()
def rows_by_place(knowledge: AttackerKnowledge, samples: Sequence[VQASample], *, seed: int = 0,
                  batch_size: int = 64) -> list[tuple[PlaceProbe, torch.Tensor, torch.Tensor]]:
    """Each place's rows [images, N, width] with each row's patch index [images, N]."""
    images = distinct_images(samples)
    n = knowledge.num_patches
    generator = torch.Generator().manual_seed(seed)
    shuffles = [torch.randperm(n, generator=generator) for _ in images]
    in_order = torch.arange(n).expand(len(images), n)
    vision: list[list[torch.Tensor]] = []
    cut: dict[str, list[torch.Tensor]] = {"patch": [], "shuffled": []}
    for start in range(0, len(images), batch_size):
        batch = images[start : start + batch_size]
        pixels = knowledge.pixel_values(batch).to(knowledge.device)
        states = vision_hidden_states(knowledge.model, pixels)
        vision.append([s.float().cpu() for s in states])
        features = states[-1]
        cut["patch"].append(torch.stack(visual_rows(knowledge.model, features, knowledge.prefix_ids,
                                                    knowledge.first_cut)).float().cpu())
        keep = shuffles[start : start + batch_size]
        cut["shuffled"].append(torch.stack(visual_rows(knowledge.model, features, knowledge.prefix_ids,
                                                       knowledge.first_cut, keep)).float().cpu())
    places = []
    for layer in range(len(vision[0])):
        rows = torch.cat([batch[layer] for batch in vision])
        name = "vision embeddings" if layer == 0 else f"vision layer {layer}"
        places.append((PlaceProbe(name, "vision", layer, "patch", rows.shape[-1]), rows, in_order))
    for order, chunks in cut.items():
        rows = torch.cat(chunks)
        labels = in_order if order == "patch" else torch.stack(shuffles)
        places.append((PlaceProbe(f"cut {knowledge.first_cut} ({order} order)", "cut", knowledge.first_cut, order,
                                  rows.shape[-1]), rows, labels))
    return places


def _classifier(probe: str, options: PositionProbeOptions):
    if probe == "linear":
        model = LogisticRegression(max_iter=options.max_iter)
    else:
        model = MLPClassifier(hidden_layer_sizes=(options.mlp_width,), max_iter=options.max_iter,
                              early_stopping=True, random_state=options.seed)
    return make_pipeline(StandardScaler(), model)


def probe_accuracy(rows: torch.Tensor, labels: torch.Tensor, probe: str, options: PositionProbeOptions) -> float:
    """Held-out top-1 accuracy of `probe` reading each row's label; rows [images, N, D], split by image."""
    images = rows.shape[0]
    order = np.random.default_rng(options.seed).permutation(images)
    test = max(1, round(options.test_share * images))
    if images - test < 1:
        raise ValueError(f"{images} images leave none to train the probes on (test_share={options.test_share})")
    test_images, train_images = order[:test], order[test:]
    x, y = rows.numpy(), labels.numpy()
    fitted = _classifier(probe, options).fit(x[train_images].reshape(-1, x.shape[-1]), y[train_images].reshape(-1))
    return float(fitted.score(x[test_images].reshape(-1, x.shape[-1]), y[test_images].reshape(-1)))


def position_probes(knowledge: AttackerKnowledge, samples: Sequence[VQASample],
                    options: PositionProbeOptions | None = None, *, progress: bool = True) -> list[PlaceProbe]:
    """Every place's probe accuracies (`PlaceProbe.accuracy`, keyed by probe)."""
    options = options or PositionProbeOptions()
    places = rows_by_place(knowledge, samples, seed=options.seed)
    bar = tqdm(total=len(places) * len(options.probes), desc="position probes", disable=not progress)
    for place, rows, labels in places:
        for probe in options.probes:
            bar.set_postfix_str(f"{place.place}: {probe}")
            place.accuracy[probe] = probe_accuracy(rows, labels, probe, options)
            bar.update()
    bar.close()
    return [place for place, _, _ in places]
