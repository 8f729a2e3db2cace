"""privacy.dp_sgd: per-sample clipping, noise of the calibrated scale, and the sample-level budget
against dp-accounting's own numbers."""

import dp_accounting
import pytest
import torch

from privacy import OptionError
from privacy.dp import DPOptions
from privacy.dp_sgd import SampleLevelDP


def library_epsilon(z, samples, batch, steps, delta):
    """dp-accounting's own epsilon with its default RDP orders (the budget's orders are fewer)."""
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(samples, batch, dp_accounting.GaussianDpEvent(z / 2)), steps)
    return accountant.get_epsilon(delta)


def test_each_sample_s_gradient_is_clipped_before_the_sum():
    dp = SampleLevelDP(DPOptions(mode="sgd", clip=1.0, noise_multiplier=1e-12), samples=100, batch=3, total_steps=1)
    param = torch.nn.Parameter(torch.zeros(2))
    grads = [[torch.tensor([3.0, 4.0])], [torch.tensor([0.3, 0.4])], [torch.tensor([0.0, -10.0])]]
    metrics = dp.private_gradients([param], iter(grads), 3, torch.Generator().manual_seed(0))
    expected = (torch.tensor([0.6, 0.8]) + torch.tensor([0.3, 0.4]) + torch.tensor([0.0, -1.0])) / 3
    torch.testing.assert_close(param.grad, expected)
    assert metrics["dp_clipped_share"] == pytest.approx(2 / 3)


def test_the_noise_has_std_z_clip_over_the_batch():
    dp = SampleLevelDP(DPOptions(mode="sgd", clip=0.5, noise_multiplier=2.0), samples=1000, batch=4, total_steps=1)
    param = torch.nn.Parameter(torch.zeros(200_000))
    dp.private_gradients([param], iter([[torch.zeros(200_000)]] * 4), 4, torch.Generator().manual_seed(0))
    assert param.grad.std().item() == pytest.approx(2.0 * 0.5 / 4, rel=0.01)


def test_the_budget_is_the_library_s_and_the_calibration_meets_its_target():
    given = SampleLevelDP(DPOptions(mode="sgd", noise_multiplier=1.1, delta=1e-4), samples=500, batch=16, total_steps=200)
    assert given.spent(200)["dp_epsilon"] == pytest.approx(library_epsilon(1.1, 500, 16, 200, 1e-4), rel=0.01)
    assert given.spent(0)["dp_epsilon"] == 0.0
    calibrated = SampleLevelDP(DPOptions(mode="sgd", target_epsilon=3.0, delta=1e-4), samples=500, batch=16, total_steps=200)
    assert calibrated.spent(200)["dp_epsilon"] == pytest.approx(3.0, abs=1e-3)
    assert calibrated.spent(100)["dp_epsilon"] < 3.0


def test_a_delta_above_one_over_the_client_s_samples_is_refused():
    with pytest.raises(OptionError) as error:
        SampleLevelDP(DPOptions(mode="sgd", noise_multiplier=1.0, delta=0.02), samples=60, batch=4, total_steps=10)
    assert error.value.option == "delta"
