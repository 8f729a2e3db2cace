"""Per-sample gradients from one backward (privacy.per_sample) are each sample's own gradient:
the same as backpropagating that sample's share alone, for weights and biases, with positions
mixed within a sample (as attention does) but never across samples."""

import pytest
import torch
from torch import nn

from privacy.per_sample import LinearSampleGradients


class Block(nn.Module):
    """Linear layers around a mixing of each sample's positions (a running mean, like causal attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.unused = nn.Linear(6, 4), nn.Linear(4, 5, bias=False), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return self.second(hidden.cumsum(1) / steps)


def test_one_backward_gives_each_samples_own_gradient():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(3, 7, 6)
    params = [model.first.weight, model.first.bias, model.second.weight, model.unused.weight]
    weights = torch.tensor([0.5, 2.0, 1.0])
    samples = LinearSampleGradients(model, params)
    with samples.recording():
        out = model(x)
    losses = out.pow(2).mean(dim=(1, 2)) * weights
    torch.autograd.grad(losses.sum(), params[:3])
    fast = samples.per_sample(3)
    for i in range(3):
        alone = torch.autograd.grad(model(x[i : i + 1]).pow(2).mean() * weights[i], params[:3])
        for got, want in zip(fast[i][:3], alone, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(fast[i][3], torch.zeros_like(model.unused.weight))  # no path from the loss
    # Read once, the batch's tensors are let go; the same reader serves the next step.
    assert not samples.inputs and not samples.output_grads
    with samples.recording():
        out = model(x.flip(0))
    torch.autograd.grad(out.pow(2).mean(dim=(1, 2)).sum(), params[:3])
    again = samples.per_sample(3)
    alone = torch.autograd.grad(model(x[:1]).pow(2).mean(), params[:3])
    for got, want in zip(again[2][:3], alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_parameter_outside_a_linear_layer_and_a_layer_run_twice_are_refused():
    model = Block()
    with pytest.raises(ValueError, match="not an nn.Linear"):
        LinearSampleGradients(model, [model.first.weight, nn.Parameter(torch.zeros(2))])
    samples = LinearSampleGradients(model, [model.first.weight])
    with pytest.raises(RuntimeError, match="ran twice"), samples.recording():
        model.first(model.first(torch.zeros(1, 2, 6))[..., :0].new_zeros(1, 2, 6))
    with samples.recording():
        model(torch.zeros(2, 3, 6)).sum().backward()
    with pytest.raises(ValueError, match="first dimension must be the sample"):
        samples.per_sample(3)


def test_on_the_tiny_models_decoder_with_padding_it_matches_one_backward_per_sample():
    """LoRA on every projection of the tiny decoder's first layers, a padded batch of uneven
    lengths: the reference is DP-SGD's former way, each sample's share backpropagated alone
    through the batch's graph."""
    from vlm.loading import build_random_model
    from vlm.lora import apply_lora, lora_parameters
    from vlm.profiles import TINY
    from vlm.segments import run_decoder_layers

    model = apply_lora(build_random_model(TINY, seed=0), rank=TINY.lora_rank)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in lora_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    params = [p for name, p in lora_parameters(model).items() if ".layers.0." in name or ".layers.1." in name]
    lengths = [5, 3, 4]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])
    hidden = torch.randn(3, 5, TINY.hidden_size, generator=generator)
    samples = LinearSampleGradients(model, params)
    with samples.recording():
        out = run_decoder_layers(model, hidden, mask, torch.arange(5).expand(3, 5), 0, 2)
    shares = [out[i, : lengths[i]].pow(2).mean() for i in range(3)]
    torch.autograd.grad(sum(shares), params, retain_graph=True)
    fast = samples.per_sample(3)
    for i, share in enumerate(shares):
        for got, want in zip(fast[i], torch.autograd.grad(share, params, retain_graph=True), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
