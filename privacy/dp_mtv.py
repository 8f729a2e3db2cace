"""DP-MTV (seed 003): a task vector made differentially private once, then used for any number of queries.

A private set of (image, question, answer) examples is split into m disjoint chunks of K
demonstrations and one target (vlm.task_vectors reads each chunk's heads at its last token).
Each chunk's activation is clipped per layer to norm C, the clipped activations are averaged,
and Gaussian noise is added once: that release is the whole cost of the vector, ε_tv. Which
heads the vector replaces is chosen on public data at no cost (MTV's REINFORCE), or privately,
by the exponential mechanism over candidate masks, at a cost ε_sel. Queries are
post-processing of the released vector and mask and spend nothing: the ledger records
releases, and a query never writes to it.

How it is accounted, where the paper leaves a choice:
- Neighbouring private sets differ in one example, which lies in one chunk (the chunks are a
  seeded partition, and as in the paper a neighbouring set is taken to change one chunk). One
  chunk moves the sum of the clipped activations by at most √|S|·C (each of |S| layers clipped
  to C); the sum is divided by the public count m, so Δ₂ = √|S|·C / m, the paper's.
- The noise's std is Δ₂ · σ(ε_tv, δ), σ from the analytic Gaussian mechanism (Balle & Wang,
  2018; dp-accounting's get_sigma_gaussian), the tightest calibration of a single Gaussian release.
- Private selection scores each candidate mask by how many chunks' targets it helps (the
  replaced model gives the target's answer a higher likelihood than the zero-shot model): each
  chunk adds 0 or 1, so one example moves every score by at most 1, and an argmax under Gumbel
  noise of scale 2/ε_sel is the exponential mechanism, ε_sel-DP. The candidates are the heads of
  each layer, all heads, and the heads whose released values are largest (several sizes):
  derived from the released vector, so post-processing, free.
- The total is ε_tv + ε_sel at δ (basic composition).
- ε_tv = inf is non-private MTV: the plain mean, no clipping and no noise.

Federated (strategies.mtv, clients.mtv): each client splits its own rows into its share of the m
chunks and sends the sum of its clipped chunk activations and its chunk count; the release is
the same Gaussian mechanism on the summed sums (`release_sum`). The unit of privacy stays one
example. The noise is drawn once by the aggregator (central), or as n shares of variance σ²/n by
the clients (distributed, under SecAgg+ so that the server only ever holds the noised sum).
"""

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import dp_accounting
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from privacy.base import OptionError
from vlm.features import VisionFeatureCache
from vlm.task_vectors import (
    HeadLayout,
    ReinforceSettings,
    FirstAnswerToken,
    chunk_activations,
    head_layout,
    reinforce_head_mask,
    replaced_heads,
)
from vqa import VQASample

PUBLIC, PRIVATE = "public", "private"
CENTRAL, DISTRIBUTED = "central", "distributed"
# The report's entry for statistics of the private activations themselves (not differentially private).
DIAGNOSTICS = "diagnostics_not_private"
SELECTIONS = {
    PUBLIC: "REINFORCE on public queries (no privacy cost)",
    PRIVATE: "the exponential mechanism over candidate masks, scored on the private chunks (costs selection_epsilon)",
}
NOISE_SITES = {
    CENTRAL: "the aggregator adds the release's noise once, to the sum of the clipped chunk activations",
    DISTRIBUTED: "each of the n clients adds N(0, σ²/n) to its own sum, so the summed noise has the calibrated σ "
                 "(under SecAgg+, no one sees a single client's sum)",
}


@dataclass
class DPMTVOptions:
    # m: disjoint chunks the private set is split into (each example in at most one); federated:
    # over all clients, each building its share of them from its own rows (chunk_counts).
    chunks: int = 32
    # K: demonstrations per chunk, before its target.
    shots: int = 4
    # C: the L2 bound of one chunk's activation at each layer.
    clip: float = 1.0
    # ε_tv of the one Gaussian release; inf: non-private MTV (the plain mean, no clipping, no noise).
    epsilon: float = 1.0
    # δ of the release; below 1 / (the private set's size).
    delta: float = 1e-5
    # public | private (SELECTIONS).
    selection: str = PUBLIC
    # ε_sel of private selection (selection = private).
    selection_epsilon: float = 0.2
    # The decoder layers whose heads the vector covers, |S|: comma-separated indices ("2,3,4");
    # "": every layer.
    layers: str = ""
    # Federated: who draws the release's noise (NOISE_SITES).
    noise: str = CENTRAL
    # Public selection: the public queries REINFORCE learns the head mask on, and its steps.
    public_queries: int = 200
    reinforce_steps: int = 100

    def validate(self, private_examples: int | None = None) -> None:
        """The options alone, and with `private_examples`, what that set can deliver."""
        if self.chunks < 1:
            raise OptionError("chunks", self.chunks, ">= 1")
        if self.shots < 0:
            raise OptionError("shots", self.shots, ">= 0")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise OptionError("clip", self.clip, "a finite number > 0")
        if not (self.epsilon > 0 and not math.isnan(self.epsilon)):
            raise OptionError("epsilon", self.epsilon, "> 0 (inf: non-private MTV)")
        if not 0 < self.delta < 1:
            raise OptionError("delta", self.delta, "a probability in (0, 1)")
        if self.selection not in SELECTIONS:
            raise OptionError("selection", self.selection, ", ".join(f"{k} ({v})" for k, v in SELECTIONS.items()))
        if self.selection == PRIVATE and not (math.isfinite(self.selection_epsilon) and self.selection_epsilon > 0):
            raise OptionError("selection_epsilon", self.selection_epsilon, "a finite number > 0 under selection=private")
        self.layer_indices  # noqa: B018 (raises on a malformed list)
        if self.noise not in NOISE_SITES:
            raise OptionError("noise", self.noise, ", ".join(f"{k} ({v})" for k, v in NOISE_SITES.items()))
        if self.public_queries < 1:
            raise OptionError("public_queries", self.public_queries, ">= 1")
        if self.reinforce_steps < 1:
            raise OptionError("reinforce_steps", self.reinforce_steps, ">= 1")
        if private_examples is None:
            return
        needed = self.chunks * (self.shots + 1)
        if needed > private_examples:
            raise OptionError("chunks", self.chunks, f"at most {private_examples // (self.shots + 1)}: {self.chunks} "
                              f"chunks of {self.shots} demonstrations and a target need {needed} examples, the private "
                              f"set has {private_examples}")
        if self.private and self.delta >= 1 / private_examples:
            raise OptionError("delta", self.delta, f"< 1/{private_examples} (the private set's size): a delta that "
                              "large lets a mechanism publish one example outright")

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)

    @property
    def layer_indices(self) -> tuple[int, ...] | None:
        """The layers as indices (None: every layer)."""
        if not self.layers.strip():
            return None
        allowed = "distinct, increasing decoder layer indices, comma-separated (empty: all)"
        try:
            indices = tuple(int(part) for part in self.layers.split(","))
        except ValueError:
            raise OptionError("layers", self.layers, allowed) from None
        if any(layer < 0 for layer in indices) or sorted(set(indices)) != list(indices):
            raise OptionError("layers", self.layers, allowed)
        return indices

    @property
    def reinforce(self) -> ReinforceSettings:
        return ReinforceSettings(steps=self.reinforce_steps)


def disjoint_chunks(examples: int, options: DPMTVOptions, seed: int) -> list[list[int]]:
    """m chunks of K + 1 example indices (demonstrations, then the target) from a seeded
    permutation of `examples`: no index in two chunks."""
    options.validate(examples)
    order = torch.randperm(examples, generator=torch.Generator().manual_seed(seed)).tolist()
    size = options.shots + 1
    return [order[chunk * size : (chunk + 1) * size] for chunk in range(options.chunks)]


def chunk_counts(chunks: int, clients: int) -> list[int]:
    """Federated: each client's share of the m chunks, by partition (as even as can be, the first
    ones one more), each built from that client's own rows."""
    return [chunks // clients + (partition < chunks % clients) for partition in range(clients)]


def client_chunks(options: DPMTVOptions, clients: int, partition: int, rows: int, seed: int) -> list[list[int]]:
    """Federated: the chunks client `partition` of `clients` builds (indices into its `rows` training
    rows): its share of the m chunks, a seeded draw of (seed, partition), so the client rebuilds the
    same ones in every message and a membership audit knows which rows went in."""
    count = chunk_counts(options.chunks, clients)[partition]
    digest = hashlib.sha256(f"mtv:chunks:{seed}:{partition}".encode()).digest()
    return disjoint_chunks(rows, replace(options, chunks=count), int.from_bytes(digest[:8], "big") >> 1)


def clip_per_layer(activations: torch.Tensor, clip: float) -> tuple[torch.Tensor, float]:
    """[chunks, layers, heads, head_dim] with each (chunk, layer) scaled to L2 norm <= clip, and
    the share of them that needed it."""
    norms = activations.flatten(2).norm(dim=-1)
    scale = (clip / norms).clamp(max=1.0)
    return activations * scale[..., None, None], float((norms > clip).float().mean())


def clipped_sum(activations: torch.Tensor, options: DPMTVOptions) -> tuple[torch.Tensor, float]:
    """What a holder of chunk activations [chunks, layers, heads, head_dim] contributes to the
    release: their sum [layers, heads, head_dim], each (chunk, layer) clipped to C first (at ε = inf
    the plain sum), and the share of them that needed it."""
    activations = activations.float().cpu()  # the noise is drawn on the CPU, by a CPU generator
    if not options.private:
        return activations.sum(0), 0.0
    clipped, clipped_share = clip_per_layer(activations, options.clip)
    return clipped.sum(0), clipped_share


def sum_noise_std(options: DPMTVOptions, layers: int) -> float:
    """The Gaussian noise's std on the sum of the clipped activations: one chunk moves that sum by
    at most √|S|·C, times the analytic mechanism's σ(ε, δ) (on the mean, over m: Δ₂ = √|S|·C/m)."""
    if not options.private:
        return 0.0
    return math.sqrt(layers) * options.clip * float(dp_accounting.get_sigma_gaussian(options.epsilon, options.delta))


def noise_share(options: DPMTVOptions, shape: Sequence[int], clients: int, generator: torch.Generator) -> torch.Tensor:
    """Distributed noise on a sum of `shape` [layers, heads, head_dim]: one of `clients` clients'
    draw, N(0, σ²/clients) with σ the sum's std, so that all their draws sum to the calibrated noise."""
    return torch.randn(tuple(shape), generator=generator) * (sum_noise_std(options, shape[0]) / math.sqrt(clients))


@dataclass
class PrivacyLedger:
    """The releases a task vector cost; queries with it are post-processing and never add one."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def charge(self, mechanism: str, epsilon: float, delta: float, **details: Any) -> None:
        self.entries.append({"mechanism": mechanism, "epsilon": epsilon, "delta": delta, **details})

    @property
    def epsilon(self) -> float:
        """The total ε by basic composition (inf when any release is non-private)."""
        return sum(entry["epsilon"] for entry in self.entries)

    @property
    def delta(self) -> float:
        return sum(entry["delta"] for entry in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "entries": list(self.entries)}


def release_sum(
    total: torch.Tensor, chunks: int, options: DPMTVOptions, generator: torch.Generator, ledger: PrivacyLedger,
    *, clients_noise_share: float | None = None,
) -> tuple[torch.Tensor, float]:
    """The task vector from the sum of `chunks` chunks' clipped activations, and its noise's std:
    the mean plus Gaussian noise drawn here once (charged to `ledger`), or, with
    `clients_noise_share`, the mean of a sum that already carries that share of the calibrated
    noise variance (distributed noise from the clients that contributed: when some dropped out it
    carries less, and the release is charged at the ε that noise gives). At ε = inf: the plain mean."""
    if not options.private:
        ledger.charge("task vector (non-private mean)", math.inf, 0.0)
        return total / chunks, 0.0
    sensitivity = math.sqrt(total.shape[0]) * options.clip
    std = sum_noise_std(options, total.shape[0])
    epsilon = options.epsilon
    if clients_noise_share is None:
        total = total + torch.randn(total.shape, generator=generator) * std
    elif clients_noise_share < 1:
        std *= math.sqrt(clients_noise_share)
        epsilon = float(dp_accounting.get_epsilon_gaussian(std / sensitivity, options.delta))
    ledger.charge("task vector (Gaussian)", epsilon, options.delta, noise_std=std / chunks,
                  sensitivity=sensitivity / chunks, chunks=chunks,
                  drawn_by="aggregator" if clients_noise_share is None else "clients")
    return total / chunks, std / chunks


def release_task_vector(
    activations: torch.Tensor, options: DPMTVOptions, generator: torch.Generator, ledger: PrivacyLedger
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The task vector [layers, heads, head_dim] from the chunks' activations [m, layers, heads,
    head_dim]: clipped, averaged and noised once (charged to `ledger`), or the plain mean at ε = inf."""
    if activations.shape[0] != options.chunks:
        raise ValueError(f"got {activations.shape[0]} chunk activations for chunks={options.chunks}")
    total, clipped_share = clipped_sum(activations, options)
    values, std = release_sum(total, options.chunks, options, generator, ledger)
    return values, {"clipped_share": clipped_share, "noise_std": std}


def candidate_masks(vector: torch.Tensor, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Head masks [layers, heads] to choose from: each layer's heads, every head, and the `sizes`
    heads (default: 1/8, 1/4 and 1/2 of them) whose released values have the largest norm."""
    layers, heads = vector.shape[:2]
    total = layers * heads
    masks = []
    for layer in range(layers):
        mask = torch.zeros(layers, heads, dtype=torch.bool)
        mask[layer] = True
        masks.append(mask)
    masks.append(torch.ones(layers, heads, dtype=torch.bool))
    norms = vector.flatten(2).norm(dim=-1).flatten()
    for size in sizes or sorted({max(1, total // 8), max(1, total // 4), max(1, total // 2)}):
        mask = torch.zeros(total, dtype=torch.bool)
        mask[norms.topk(size).indices] = True
        masks.append(mask.view(layers, heads))
    unique: dict[bytes, torch.Tensor] = {}
    for mask in masks:
        unique.setdefault(mask.numpy().tobytes(), mask)
    return list(unique.values())


def exponential_mechanism(
    scores: Sequence[float], epsilon: float, sensitivity: float, generator: torch.Generator
) -> int:
    """argmax of scores + Gumbel noise of scale 2·sensitivity/epsilon: the exponential mechanism
    (ε-DP for scores that one example moves by at most `sensitivity`)."""
    scale = 2 * sensitivity / epsilon
    uniform = torch.rand(len(scores), generator=generator, dtype=torch.float64).clamp(min=1e-300)
    gumbel = -torch.log(-torch.log(uniform))
    return int(torch.argmax(torch.tensor(scores, dtype=torch.float64) + scale * gumbel))


@dataclass
class TaskVector:
    """A released task vector, the heads it replaces, and what it cost."""

    layout: HeadLayout
    values: torch.Tensor
    mask: torch.Tensor
    ledger: PrivacyLedger
    report: dict[str, Any]

    def intervention(self, model: nn.Module):
        """For vlm.answering.answer_questions: a fresh head replacement per batch, in which `model`
        answers with this task vector (post-processing: free)."""
        return lambda: replaced_heads(model, self.layout, self.values, self.mask)

    def save(self, path: str | Path) -> None:
        """The release as it may be shared: the report's non-private diagnostics stay out."""
        report = {key: value for key, value in self.report.items() if key != DIAGNOSTICS}
        torch.save({"layers": list(self.layout.layers), "heads": self.layout.heads, "head_dim": self.layout.head_dim,
                    "values": self.values, "mask": self.mask, "ledger": self.ledger.to_dict(), "report": report},
                   Path(path))


def private_selection_scores(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    targets: Sequence[VQASample],
    layout: HeadLayout,
    values: torch.Tensor,
    masks: Sequence[torch.Tensor],
    *,
    instruction: str | None,
) -> list[int]:
    """Per candidate mask, the chunks whose target's answer it makes more likely than the
    zero-shot model does (each chunk adds 0 or 1: sensitivity 1 per example)."""
    with torch.no_grad():
        answers = FirstAnswerToken(model, tokenizer, features, targets, instruction=instruction)
        zero_shot = answers.log_likelihood()
        scores = []
        for mask in masks:
            with replaced_heads(model, layout, values, mask):
                replaced = answers.log_likelihood()
            scores.append(int((replaced > zero_shot).sum()))
    return scores


def build_task_vector(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    private: Sequence[VQASample],
    public: Sequence[VQASample],
    options: DPMTVOptions,
    *,
    instruction: str | None,
    seed: int,
    progress: bool = True,
) -> TaskVector:
    """DP-MTV on `private` (chunks, per-layer clipping, one Gaussian release), heads chosen on
    `public` by REINFORCE or privately among candidate masks; ε = inf gives non-private MTV."""
    options.validate(len(private))
    layout = head_layout(model, options.layer_indices)
    chunks = [[private[index] for index in chunk] for chunk in disjoint_chunks(len(private), options, seed)]
    activations = chunk_activations(model, tokenizer, features, chunks, layout, instruction=instruction,
                                    progress=progress)
    ledger = PrivacyLedger()
    generator = torch.Generator().manual_seed(seed)
    values, release = release_task_vector(activations, options, generator, ledger)
    report: dict[str, Any] = {
        "options": asdict(options), "layers": list(layout.layers), "heads_per_layer": layout.heads,
        "head_dim": layout.head_dim, "noise_std": release["noise_std"],
        # Read off the private activations without noise: for the researcher, never saved with the vector.
        DIAGNOSTICS: {"clipped_share": release["clipped_share"],
                      "activation_norm_median": float(activations.float().flatten(2).norm(dim=-1).median())},
    }
    if options.selection == PUBLIC:
        if not public:
            raise OptionError("selection", options.selection, "private when no public queries are given")
        mask, rewards = reinforce_head_mask(model, tokenizer, features, public, layout, values, options.reinforce,
                                            instruction=instruction, generator=generator, progress=progress)
        report["selection"] = {"method": PUBLIC, "reinforce": asdict(options.reinforce), "rewards": rewards}
    else:
        masks = candidate_masks(values)
        scores = private_selection_scores(model, tokenizer, features, [chunk[-1] for chunk in chunks], layout, values,
                                          masks, instruction=instruction)
        chosen = exponential_mechanism(scores, options.selection_epsilon, 1.0, generator)
        mask = masks[chosen]
        ledger.charge("head selection (exponential mechanism)", options.selection_epsilon, 0.0,
                      candidates=len(masks))
        report["selection"] = {"method": PRIVATE, "candidates": len(masks), "chosen": chosen}
    report["selected_heads"] = int(mask.sum())
    report["ledger"] = ledger.to_dict()
    return TaskVector(layout, values, mask, ledger, report)
