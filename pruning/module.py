"""QPriv-VL's trainable part (SPEC §1): relevance, sensitivity, fusion and the threshold head.

Inputs are the frozen per-sample features: the CLIP vision patches LLaVA already
computes (its feature layer, [B, N, Dv]), the CLIP text question vector ([B, Dt]) and
DINOv2 patch features ([B, Nd, Dd]). The pooled image vector is the mean of the CLIP
patches: LLaVA reads the penultimate layer, whose CLS token it drops, so the mean is
the cheap deterministic summary available from the features already cached.

At the llava-1.5-7b size: Wq 196,608 + Wk 262,144 = 458,752; H_sens 65,921;
MLPτ 1,182,721; γ 1; total 1,707,395.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from pruning.profiles import PruningProfile

GAMMA_INIT = 3.0
# A DINO-grid patch counts as sensitive in the threshold head's summary above this.
SENSITIVE_ABOVE = 0.5


@dataclass
class QPrivVLOutput:
    """Per-patch maps on the CLIP grid ([B, N], row-major) and the per-sample ratio.

    relevance: u = σ(qᵀK/√P) in (0, 1). sensitivity_dino: σ(H_sens) on the DINO grid
    [B, Nd]. sensitivity: that map bilinearly upsampled to the CLIP grid (s_aligned).
    score: the ranking score c = α·u − β·s. soft_mask: σ(γ·c), the differentiable
    mask the student distils. ratio: the predicted prune ratio ρ̂ in (0, 1), [B].
    """

    relevance: torch.Tensor
    sensitivity_dino: torch.Tensor
    sensitivity: torch.Tensor
    score: torch.Tensor
    soft_mask: torch.Tensor
    ratio: torch.Tensor


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Linear layers with biases and GELU between them; the last layer's output is left raw (a logit)."""
    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(pairwise(sizes)):
        if index:
            layers.append(nn.GELU())
        layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers)


class QPrivVL(nn.Module):
    """The scorer and the Dynamic Threshold Predictor.

    Trainable parameters: `query_projection` (Wq, text -> P) and `key_projection`
    (Wk, Dv -> P), both bias-free; `sensitivity_head` (H_sens, Dd -> … -> 1, logits);
    `threshold_head` (MLPτ, [pooled; question; summary] -> … -> 1, logit of ρ̂); and
    `gamma` (γ, init 3.0). `alpha` and `beta` weight the fusion and are settings, not
    parameters (α = 0 ranks by privacy alone): they are not part of the state dict.
    """

    def __init__(self, profile: PruningProfile, *, alpha: float = 1.0, beta: float = 1.0) -> None:
        super().__init__()
        self.profile = profile
        self.alpha, self.beta = alpha, beta
        self.query_projection = nn.Linear(profile.text_hidden_size, profile.projection_dim, bias=False)
        self.key_projection = nn.Linear(profile.vision_hidden_size, profile.projection_dim, bias=False)
        self.sensitivity_head = mlp([profile.dino_hidden_size, *profile.sensitivity_hidden, 1])
        self.threshold_head = mlp([profile.threshold_input_size, *profile.threshold_hidden, 1])
        self.gamma = nn.Parameter(torch.tensor(GAMMA_INIT))

    def relevance(self, vision_patches: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        """u [B, N]: how much each CLIP patch matters to the question."""
        query = self.query_projection(question)  # [B, P]
        keys = self.key_projection(vision_patches)  # [B, N, P]
        logits = torch.einsum("bp,bnp->bn", query, keys) / self.profile.projection_dim**0.5
        return torch.sigmoid(logits)

    def patch_sensitivity(self, dino_patches: torch.Tensor) -> torch.Tensor:
        """s [B, Nd] in (0, 1) on the DINO grid (`sensitivity_head` alone gives the logits)."""
        return torch.sigmoid(self.sensitivity_head(dino_patches).squeeze(-1))

    def align(self, sensitivity_dino: torch.Tensor) -> torch.Tensor:
        """Bilinear upsample of the DINO-grid map [B, Nd] to the CLIP grid [B, N]."""
        dino_grid, clip_grid = self.profile.dino_grid, self.profile.clip_grid
        grid = sensitivity_dino.reshape(-1, 1, dino_grid, dino_grid)
        return F.interpolate(grid, size=(clip_grid, clip_grid), mode="bilinear", align_corners=False).flatten(1)

    def threshold_input(
        self, vision_patches: torch.Tensor, question: torch.Tensor, sensitivity_dino: torch.Tensor
    ) -> torch.Tensor:
        """x [B, Dv + Dt + 3]: pooled image, question, and the mean, max and fraction > 0.5
        of the sensitivity map on the DINO grid (the head's own output, before upsampling)."""
        summary = torch.stack(
            [
                sensitivity_dino.mean(dim=1),
                sensitivity_dino.amax(dim=1),
                (sensitivity_dino > SENSITIVE_ABOVE).to(sensitivity_dino.dtype).mean(dim=1),
            ],
            dim=1,
        )
        return torch.cat([vision_patches.mean(dim=1), question, summary], dim=1)

    def predict_ratio(self, threshold_input: torch.Tensor) -> torch.Tensor:
        """ρ̂ [B] in (0, 1)."""
        return torch.sigmoid(self.threshold_head(threshold_input).squeeze(-1))

    def forward(
        self, vision_patches: torch.Tensor, question: torch.Tensor, dino_patches: torch.Tensor
    ) -> QPrivVLOutput:
        """vision_patches [B, N, Dv], question [B, Dt], dino_patches [B, Nd, Dd]."""
        relevance = self.relevance(vision_patches, question)
        sensitivity_dino = self.patch_sensitivity(dino_patches)
        sensitivity = self.align(sensitivity_dino)
        score = self.alpha * relevance - self.beta * sensitivity
        return QPrivVLOutput(
            relevance=relevance,
            sensitivity_dino=sensitivity_dino,
            sensitivity=sensitivity,
            score=score,
            soft_mask=torch.sigmoid(self.gamma * score),
            ratio=self.predict_ratio(self.threshold_input(vision_patches, question, sensitivity_dino)),
        )


def build_qpriv_vl(profile: PruningProfile, *, seed: int, alpha: float = 1.0, beta: float = 1.0) -> QPrivVL:
    """A seeded, untrained module (the same seed gives the same weights; global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return QPrivVL(profile, alpha=alpha, beta=beta)


def keep_count(ratio: float, num_patches: int, k_min: int) -> int:
    """k = max(k_min, round((1 − ρ)·N)) for ρ in [0, 1]; round half to even, as Python's round."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"prune ratio {ratio!r} is outside [0, 1]")
    return max(k_min, round((1 - ratio) * num_patches))


def keep_indices(score: torch.Tensor, ratios: Sequence[float] | torch.Tensor, k_min: int) -> list[torch.Tensor]:
    """Per sample, the ascending indices of the top-k patches by `score` [B, N], k from its ratio."""
    ratios = ratios.tolist() if isinstance(ratios, torch.Tensor) else list(ratios)
    if len(ratios) != score.shape[0]:
        raise ValueError(f"{len(ratios)} prune ratios for a batch of {score.shape[0]} samples")
    num_patches = score.shape[1]
    return [
        torch.topk(row, keep_count(ratio, num_patches, k_min)).indices.sort().values
        for row, ratio in zip(score, ratios, strict=True)
    ]
