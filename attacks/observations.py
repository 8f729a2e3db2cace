"""From recorded transfers to what image attacks invert: each sample's visual rows at the first cut.

A sample's packed rows are [template prefix | k_b visual tokens | question and the
rest]. The prefix length is public; k_b is N when nothing is pruned, and otherwise
found by `VisualSpans`, a logistic regression the attacker fits on rows its public
front produces for auxiliary samples (visual vs text rows are easy to tell apart).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from attacks.knowledge import AttackerKnowledge, split_packed
from attacks.marks import MarkReader, mark_readback, public_marks
from attacks.metrics import image_metrics, mean_image_baseline
from attacks.recording import RecordedTransfer, Recording
from privacy import defense_class, parse_defense_names
from training import protocol
from vlm.segments import (
    merge_multimodal_inputs,
    project_visual_features,
    run_decoder_layers,
)
from vqa import VQASample

# Pruning policies under which every patch crosses the cut, in order.
UNPRUNED_POLICIES = ("off",)


@dataclass(frozen=True)
class VisualObservation:
    """One sample's visual rows [k, D] as the server received them."""

    entry: RecordedTransfer
    index: int
    rows: torch.Tensor


class VisualSpans:
    """Where a sample's visual rows end, when pruning makes k_b unknown."""

    def __init__(self, knowledge: AttackerKnowledge, cut: int) -> None:
        self.knowledge, self.cut = knowledge, cut
        self.classifier = None

    @torch.no_grad()
    def fit(self, aux: Sequence[VQASample], seed: int = 0, max_samples: int = 64) -> "VisualSpans":
        """Rows of whole prompts (random keep counts) labelled visual or text."""
        k = self.knowledge
        aux = list(aux)[:max_samples]
        generator = torch.Generator().manual_seed(seed)
        features = k.features(k.pixel_values(aux))
        visual = []
        for feature in features:
            count = int(torch.randint(1, k.num_patches + 1, (1,), generator=generator))
            keep = torch.randperm(k.num_patches, generator=generator)[:count].sort().values
            visual.append(project_visual_features(k.model, feature[keep].unsqueeze(0).to(k.device))[0])
        inputs = merge_multimodal_inputs(
            k.model, [k.prompt_ids(s.question) for s in aux], visual, [k.answer_ids(s.answer) for s in aux]
        )
        rows = run_decoder_layers(k.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, self.cut)
        real = inputs.attention_mask.bool()
        self.classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
        self.classifier.fit(rows[real].float().cpu().numpy(), inputs.visual_token_mask[real].cpu().numpy())
        return self

    def count(self, sample_rows: torch.Tensor) -> int:
        """k_b: the split after the prefix that best separates visual from text rows."""
        if self.classifier is None:
            raise RuntimeError("VisualSpans.fit must run before count (the run prunes: k_b is unknown)")
        prefix = self.knowledge.prefix_ids.numel()
        body = sample_rows[prefix:].float().cpu().numpy()
        # log p(visual) and log p(text) from the logit, as log-sigmoids: finite however sure the
        # classifier is (log of its rounded probabilities would be -inf).
        logit = self.classifier.decision_function(body)
        logit = logit if bool(self.classifier.classes_[1]) else -logit
        log_visual, log_text = -np.logaddexp(0.0, -logit), -np.logaddexp(0.0, logit)
        # Score of "the first k rows are visual": prefix sums of log p(visual) plus suffix sums of log p(text).
        visual_prefix = np.concatenate([[0.0], np.cumsum(log_visual)])
        text_suffix = np.concatenate([np.cumsum(log_text[::-1])[::-1], [0.0]])
        scores = (visual_prefix + text_suffix)[1 : self.knowledge.num_patches + 1]
        return int(np.argmax(scores)) + 1


def fewer_visual_rows(config: Mapping[str, Any]) -> bool:
    """Whether a run (its flat config) may send fewer than N visual rows per sample, so that the
    server must find where each sample's end: it prunes, or an EDGE defense removes tokens (ToMe,
    drop). A recording made outside a run (no config): assume so."""
    if config.get("pruning.policy", "unknown") not in UNPRUNED_POLICIES:
        return True
    names = parse_defense_names(str(config.get("privacy.defenses") or ""))
    return any(getattr(defense_class(name), "removes_tokens", False) for name in names)


def visual_observations(
    recording: Recording, knowledge: AttackerKnowledge, *, attack: str, spans: VisualSpans | None
) -> list[VisualObservation]:
    """Every stored training activation at the first cut, split into samples' visual rows.

    `spans` locates k_b when the run prunes; with None every sample must carry all N
    visual tokens (an unpruned run).
    """
    kind = recording.first_cut_kind(attack=attack)
    prefix = knowledge.prefix_ids.numel()
    observations = []
    for entry in recording.require(kind, attack=attack):
        tensors = recording.tensors(entry)
        for index, rows in enumerate(split_packed(tensors[protocol.ROWS], tensors[protocol.LENGTHS])):
            count = knowledge.num_patches if spans is None else spans.count(rows)
            if rows.shape[0] < prefix + count:
                raise ValueError(
                    f"{attack}: sample {index} of transfer {entry.seq} has {rows.shape[0]} rows, fewer than the "
                    f"prefix ({prefix}) and {count} visual tokens; is the recording from this model?"
                )
            observations.append(VisualObservation(entry, index, rows[prefix : prefix + count].float()))
    return observations


@dataclass
class ImageScore:
    """Reconstructions against the truth: metrics, and the targets with their positions among the observations."""

    metrics: dict[str, float]
    targets: torch.Tensor
    known: list[int]


def score_images(
    observations: Sequence[VisualObservation],
    images: torch.Tensor,
    knowledge: AttackerKnowledge,
    truth,
    aux: Sequence[VQASample],
    aux_images: torch.Tensor,
) -> ImageScore | None:
    """PSNR/SSIM/FSIM of the reconstructions the truth can score, the mean auxiliary image's
    (`baseline_*`), and on the stamped benchmark whether the mark reads back. None when the
    truth knows none of the observed samples."""
    known, samples = [], []
    cache: dict[int, list[VQASample] | None] = {}
    for position, observation in enumerate(observations):
        seq = observation.entry.seq
        if seq not in cache:
            cache[seq] = truth.samples(observation.entry)
        if cache[seq] is not None:
            known.append(position)
            samples.append(cache[seq][observation.index])
    if not samples:
        return None
    targets = knowledge.unit_images(knowledge.pixel_values(samples))
    reconstructions = images[known]
    metrics = image_metrics(reconstructions, targets)
    metrics.update({f"baseline_{name}": value for name, value in mean_image_baseline(aux_images, targets).items()})
    marked = [(i, truth.mark(s)) for i, s in enumerate(samples) if truth.mark(s) is not None]
    # The attacker's own images' marks are public (their split's records), wherever the run's are.
    aux_marked = [(i, mark) for i, mark in enumerate(public_marks(aux)) if mark is not None]
    if marked and aux_marked:
        reader = MarkReader().fit(aux_images[[i for i, _ in aux_marked]], [m for _, m in aux_marked])
        rows = [i for i, _ in marked]
        metrics.update(mark_readback(reader, reconstructions[rows], targets[rows], [m for _, m in marked]))
    return ImageScore(metrics, targets, known)
