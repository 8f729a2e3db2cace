"""The metrics: library values where a library computes them, and the FSIM port held to piq's numbers."""

import math

import pytest
import torch

from attacks.fsim import fsim
from attacks.metrics import (
    image_metrics,
    label_accuracy,
    mean_image_baseline,
    membership_metrics,
    psnr,
    puri,
    rouge_l,
    text_metrics,
    token_precision_recall,
)


def test_fsim_matches_piq():
    """Values piq 0.8.0's `piq.fsim` gave for these inputs (reduction="none")."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(3, 3, 32, 32, generator=generator)
    y = (x + 0.1 * torch.randn(3, 3, 32, 32, generator=generator)).clamp(0, 1)
    z = torch.rand(3, 3, 64, 64, generator=generator)
    w = (z * 0.7 + 0.15).clamp(0, 1)
    expected = {
        "noisy, chromatic": (fsim(x, y), [0.947918176651001, 0.9439795017242432, 0.9419853091239929]),
        "noisy, luminance": (fsim(x, y, chromatic=False), [0.9616973400115967, 0.9577568173408508, 0.9558994174003601]),
        "contrast, chromatic": (fsim(z, w), [0.9422172904014587, 0.9433561563491821, 0.9442505836486816]),
        "contrast, luminance": (fsim(z, w, chromatic=False), [0.9448909163475037, 0.9460397958755493, 0.9469245672225952]),
    }
    for case, (got, want) in expected.items():
        assert got.tolist() == pytest.approx(want, abs=1e-5), case
    assert fsim(x, x).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_image_metrics_rank_a_closer_reconstruction_higher():
    generator = torch.Generator().manual_seed(1)
    target = torch.rand(4, 3, 32, 32, generator=generator)
    close = (target + 0.02 * torch.randn(target.shape, generator=generator)).clamp(0, 1)
    far = (target + 0.3 * torch.randn(target.shape, generator=generator)).clamp(0, 1)
    good, bad = image_metrics(close, target), image_metrics(far, target)
    assert all(good[name] > bad[name] for name in ("psnr", "ssim", "fsim"))
    # PSNR of a uniform error e is 10·log10(1/e²).
    assert float(psnr(torch.full((1, 3, 8, 8), 0.6), torch.full((1, 3, 8, 8), 0.5))) == pytest.approx(20.0, abs=1e-4)
    # The mean-image guess of one image is that image.
    assert mean_image_baseline(target[:1], target[:1])["ssim"] == pytest.approx(1.0, abs=1e-4)


def test_membership_metrics():
    perfect = membership_metrics([0.9, 0.8, 0.2, 0.1], [True, True, False, False])
    assert perfect["auc"] == 1.0 and perfect["attack_success"] == 1.0 and perfect["tpr_at_fpr_0.01"] == 1.0
    inverted = membership_metrics([0.1, 0.2, 0.8, 0.9], [True, True, False, False])
    assert inverted["auc"] == 0.0 and inverted["attack_success"] == 0.0 and inverted["tpr_at_fpr_0.01"] == 0.0
    with pytest.raises(ValueError, match="both members and non-members"):
        membership_metrics([0.5, 0.6], [True, True])


def test_text_and_label_metrics():
    assert token_precision_recall([1, 2, 3, 9], [1, 2, 3]) == (0.75, 1.0)
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([3, 2, 1], [1, 2, 3]) == pytest.approx(1 / 3)
    metrics = text_metrics([[1, 2], [5]], [[1, 2], [6]])
    assert metrics == {"token_precision": 0.5, "token_recall": 0.5, "rouge_l": 0.5, "exact_match": 0.5}
    assert label_accuracy([[4, 3], [5, 3]], [[4, 3], [6, 3]]) == {"label_accuracy": 0.5,
                                                                   "label_token_accuracy": 0.75}


def test_puri_follows_its_definition():
    base = {"ssim": 0.8, "psnr": 20.0, "fsim": 0.9}
    # The attack does as well as undefended: no privacy, PURI 0 whatever the utility.
    assert puri(0.9, 0.9, base, base) == 0.0
    # Nothing reconstructed (P = 1) at full utility (U = 1): PURI 1.
    assert puri(0.9, 0.9, {"ssim": 0.0, "psnr": 0.0, "fsim": 0.0}, base) == 1.0
    # Half of each reconstruction metric (P = 0.5), half the accuracy (U = 0.5): U·P / (0.7P + 0.3U).
    half = {key: value / 2 for key, value in base.items()}
    assert puri(0.45, 0.9, half, base) == pytest.approx(0.25 / 0.5)
    assert math.isclose(puri(0.9, 0.9, half, base), 0.5 / (0.7 * 0.5 + 0.3))
