"""How well an attack did, from well-kept libraries where they exist.

Images: PSNR and SSIM from torchmetrics, FSIM from attacks.fsim (a port of piq's,
see there why). Membership: AUC, attack success and TPR at a low FPR from
scikit-learn. Text: token precision/recall (bag-of-tokens overlap, the ActInv
paper's definition) and ROUGE-L from Google's rouge-score. PURI is SPEC.md §3's
formula. Every image metric takes [B, 3, H, W] tensors in [0, 1].
"""

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from rouge_score import rouge_scorer
from scipy.stats import beta
from sklearn.metrics import roc_auc_score, roc_curve
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)

from attacks.fsim import fsim

# SPEC.md §3: PURI weighs privacy over utility with λ = 0.7.
PURI_LAMBDA = 0.7
# Low false-positive rates at which membership attacks are compared (Carlini et al.'s practice).
LOW_FPRS = (0.01, 0.001)


def _check_images(reconstructed: torch.Tensor, target: torch.Tensor) -> None:
    if reconstructed.shape != target.shape or reconstructed.ndim != 4:
        raise ValueError(
            f"image metrics need two [B, C, H, W] tensors of one shape, got {tuple(reconstructed.shape)} "
            f"and {tuple(target.shape)}"
        )


def psnr(reconstructed: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB (data range 1)."""
    _check_images(reconstructed, target)
    return peak_signal_noise_ratio(
        reconstructed.float(), target.float(), data_range=1.0, reduction="none", dim=(1, 2, 3)
    )


def ssim(reconstructed: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM (Gaussian window, σ = 1.5; the window shrinks for images under 11 pixels)."""
    _check_images(reconstructed, target)
    kernel = min(11, *target.shape[-2:]) | 1
    return structural_similarity_index_measure(
        reconstructed.float(), target.float(), data_range=1.0, reduction="none", kernel_size=kernel
    )


def image_metrics(reconstructed: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """Mean PSNR, SSIM and FSIM(c) of a batch of reconstructions."""
    _check_images(reconstructed, target)
    reconstructed = reconstructed.detach().clamp(0, 1)
    return {
        "psnr": float(psnr(reconstructed, target).mean()),
        "ssim": float(ssim(reconstructed, target).mean()),
        "fsim": float(fsim(reconstructed, target).mean()),
    }


def mean_image_baseline(reference_images: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """The trivial attacker: the mean of its auxiliary images, guessed for every target."""
    guess = reference_images.float().mean(0, keepdim=True).expand_as(target)
    return image_metrics(guess, target)


def membership_metrics(scores: Sequence[float], is_member: Sequence[bool]) -> dict[str, float]:
    """AUC, attack success (accuracy of the 0.5 decision) and TPR at low FPRs.

    `scores` are the attack's membership probabilities; attack success is the share
    of candidates it classifies correctly, the paper's "MIA attack success".
    """
    scores, labels = np.asarray(scores, dtype=float), np.asarray(is_member, dtype=bool)
    if labels.all() or not labels.any():
        raise ValueError("membership metrics need both members and non-members among the candidates")
    fpr, tpr, _ = roc_curve(labels, scores)
    metrics = {
        "auc": float(roc_auc_score(labels, scores)),
        "attack_success": float(((scores >= 0.5) == labels).mean()),
        "member_share": float(labels.mean()),
    }
    for low in LOW_FPRS:
        # The best TPR among operating points whose FPR does not exceed `low`.
        metrics[f"tpr_at_fpr_{low:g}"] = float(tpr[fpr <= low].max())
    return metrics


def audit_epsilon(scores: Sequence[float], is_member: Sequence[bool], delta: float, *, confidence: float = 0.95,
                  seed: int = 0) -> dict[str, float]:
    """An empirical lower bound on epsilon from a membership audit (Jagielski et al. 2020; Nasr et
    al. 2021): any (epsilon, delta)-DP training bounds every test's false positive and false
    negative rates by FNR >= (1 - delta - FPR) / e^epsilon, so the rates an attack reaches give
    epsilon >= log((1 - delta - FNR) / FPR) (and with the roles swapped). The rates are taken at
    their one-sided Clopper–Pearson upper bounds at `confidence`, and the threshold is chosen on
    a random half of the candidates and bounded on the other half, so the bound holds at that
    confidence (written here: the formula is a few lines over scipy's beta quantiles)."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(is_member, dtype=bool)
    order = np.random.default_rng(seed).permutation(len(scores))
    choose, bound = order[: len(order) // 2], order[len(order) // 2 :]

    def epsilon_at(threshold: float, part: np.ndarray) -> float:
        member, guessed = labels[part], scores[part] >= threshold
        fpr = _clopper_pearson_upper(int((guessed & ~member).sum()), int((~member).sum()), confidence)
        fnr = _clopper_pearson_upper(int((~guessed & member).sum()), int(member.sum()), confidence)
        return max(np.log(max(1 - delta - fnr, 1e-300) / fpr), np.log(max(1 - delta - fpr, 1e-300) / fnr))

    if not (labels[choose].any() and (~labels[choose]).any() and labels[bound].any() and (~labels[bound]).any()):
        raise ValueError("the membership audit needs members and non-members in both halves of its candidates")
    threshold = max(np.unique(scores[choose]), key=lambda t: epsilon_at(t, choose))
    return {"audit_epsilon": max(0.0, float(epsilon_at(threshold, bound))),
            "audit_delta": float(delta), "audit_confidence": float(confidence)}


def _clopper_pearson_upper(successes: int, trials: int, confidence: float) -> float:
    """The one-sided Clopper–Pearson upper bound of a binomial rate."""
    if successes >= trials:
        return 1.0
    return float(beta.ppf(confidence, successes + 1, trials - successes))


def token_precision_recall(recovered: Sequence[int], original: Sequence[int]) -> tuple[float, float]:
    """Bag-of-tokens overlap: correct recovered tokens over recovered (precision) and over original (recall)."""
    overlap = sum((Counter(recovered) & Counter(original)).values())
    precision = overlap / len(recovered) if recovered else 0.0
    recall = overlap / len(original) if original else 0.0
    return precision, recall


class _IdTokenizer:
    """rouge-score tokenizer for token-id sequences written as space-separated ids."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


_ROUGE = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_IdTokenizer())


def rouge_l(recovered: Sequence[int], original: Sequence[int]) -> float:
    """ROUGE-L F-measure of two token-id sequences."""
    return float(_ROUGE.score(_as_text(original), _as_text(recovered))["rougeL"].fmeasure)


def _as_text(ids: Sequence[int]) -> str:
    return " ".join(str(int(i)) for i in ids)


def text_metrics(recovered: Sequence[Sequence[int]], original: Sequence[Sequence[int]]) -> dict[str, float]:
    """Mean token precision, recall and ROUGE-L over samples, and the share recovered exactly."""
    if len(recovered) != len(original) or not original:
        raise ValueError(f"got {len(recovered)} recovered and {len(original)} original sequences")
    pairs = [token_precision_recall(r, o) for r, o in zip(recovered, original, strict=True)]
    return {
        "token_precision": float(np.mean([p for p, _ in pairs])),
        "token_recall": float(np.mean([r for _, r in pairs])),
        "rouge_l": float(np.mean([rouge_l(r, o) for r, o in zip(recovered, original, strict=True)])),
        "exact_match": float(np.mean([list(r) == list(o) for r, o in zip(recovered, original, strict=True)])),
    }


def label_accuracy(recovered: Sequence[Sequence[int]], original: Sequence[Sequence[int]]) -> dict[str, float]:
    """iDLG: share of samples whose whole label sequence is recovered, and share of label tokens."""
    if len(recovered) != len(original) or not original:
        raise ValueError(f"got {len(recovered)} recovered and {len(original)} original label sequences")
    exact = [list(r) == list(o) for r, o in zip(recovered, original, strict=True)]
    tokens = sum(
        sum(a == b for a, b in zip(r, o, strict=False)) for r, o in zip(recovered, original, strict=True)
    )
    return {
        "label_accuracy": float(np.mean(exact)),
        "label_token_accuracy": tokens / max(1, sum(len(o) for o in original)),
    }


def puri(
    accuracy: float,
    base_accuracy: float,
    reconstruction: dict[str, float],
    base_reconstruction: dict[str, float],
    lam: float = PURI_LAMBDA,
) -> float:
    """PURI_λ = U·P / (λ·P + (1 − λ)·U) (SPEC.md §3).

    U = accuracy / undefended accuracy; P = max(0, 1 − mean of SSIM, PSNR and FSIM,
    each over its undefended value): 0 when the attack does as well as undefended,
    1 when it recovers nothing.
    """
    ratios = [reconstruction[key] / base_reconstruction[key] for key in ("ssim", "psnr", "fsim")]
    utility = accuracy / base_accuracy
    privacy = max(0.0, 1.0 - sum(ratios) / 3)
    denominator = lam * privacy + (1 - lam) * utility
    return utility * privacy / denominator if denominator > 0 else 0.0
