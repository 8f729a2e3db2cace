"""How well an attack did, from well-kept libraries where they exist.

Images: PSNR and SSIM from torchmetrics, FSIM from attacks.fsim (a port of piq's,
see there why). Membership: AUC, attack success and TPR at a low FPR from
scikit-learn. Text: token precision/recall (bag-of-tokens overlap, the ActInv
paper's definition) and ROUGE-L from Google's rouge-score. PURI is SPEC.md §3's
formula. Every image metric takes [B, 3, H, W] tensors in [0, 1].
"""

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch
from rouge_score import rouge_scorer
from scipy.stats import binom
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


# The auditor's guess counts (Steinke et al. 2023 guess "member" for the k+ highest scores and
# "non-member" for the k- lowest, abstaining on the rest): shares of the canaries, each side.
# Fixed before any score is seen; the bound pays for trying them all (Bonferroni).
GUESS_SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability that an (epsilon, delta)-DP training lets an auditor guess `correct` or more of
    its `guesses` right, each of `canaries` included independently with probability 1/2 (Steinke,
    Nasr & Jagielski 2023, Theorem 5.2): P[Binomial(r, q) >= v] + 2·m·delta·max_i P[v > Binomial(r, q)
    >= v - i] / i, with q = e^epsilon / (1 + e^epsilon), the accuracy of epsilon-DP randomized response."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries ({canaries})")
    q = 1 / (1 + np.exp(-epsilon))
    tail = float(binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    below = np.cumsum(binom.pmf(correct - np.arange(1, correct + 1), guesses, q))
    return min(1.0, tail + 2 * canaries * delta * float((below / np.arange(1, correct + 1)).max()))


def one_run_epsilon(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon that `correct` of `guesses` right rejects at `confidence` (one_run_p_value
    below 1 - confidence): the one-run audit's lower bound; 0 when not even epsilon = 0 is rejected.
    By bisection (the p-value grows with epsilon; written here: a few lines over scipy's binomial)."""
    level = 1 - confidence
    if one_run_p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2 * high
        if high > 1e3:  # a perfect guess of more canaries than any test here
            return low
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if one_run_p_value(canaries, guesses, correct, middle, delta) < level else (low, middle)
    return low


def one_run_audit(scores: Sequence[float], included: Sequence[bool], delta: float, *, confidence: float = 0.95,
                  guess_shares: Sequence[float] = GUESS_SHARES) -> dict[str, float]:
    """Steinke et al.'s one-run audit of a training whose canaries were each included independently
    with probability 1/2 (`included`; `scores`: the attack's membership scores, higher = member).
    For each guess share s in `guess_shares` the auditor guesses "in" for the round(s·m) highest
    scores and "out" for as many lowest, abstaining on the rest; each choice is tested at
    (1 - confidence) / len(guess_shares), so the best of them holds at `confidence`."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    canaries = len(scores)
    if canaries != len(labels) or canaries < 2:
        raise ValueError(f"the one-run audit needs one inclusion flag per score and at least 2 canaries, got "
                         f"{canaries} scores and {len(labels)} flags")
    order = np.argsort(-scores, kind="stable")
    each = 1 - (1 - confidence) / len(guess_shares)
    best = {"audit_epsilon": 0.0, "audit_guesses": 0, "audit_correct": 0}
    for share_ in guess_shares:
        side = min(canaries // 2, max(1, round(share_ * canaries)))
        correct = int(labels[order[:side]].sum() + (~labels[order[-side:]]).sum())
        epsilon = one_run_epsilon(canaries, 2 * side, correct, delta, each)
        if epsilon > best["audit_epsilon"] or not best["audit_guesses"]:
            best = {"audit_epsilon": epsilon, "audit_guesses": 2 * side, "audit_correct": correct}
    return {**best, "audit_canaries": canaries, "audit_delta": float(delta), "audit_confidence": float(confidence)}


def canary_audit(score: Callable[[list], Sequence[float]], truth, delta: float) -> dict[str, float]:
    """`one_run_audit` over the truth's canaries (every one, included or not), scored by `score`."""
    canaries = truth.canaries()
    if canaries is None:
        raise ValueError("the canary audit needs a run with data.canaries (its truth has no canaries)")
    included, excluded = canaries
    return one_run_audit(score([*included, *excluded]), [True] * len(included) + [False] * len(excluded), delta)


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
