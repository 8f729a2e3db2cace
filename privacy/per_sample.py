"""Each sample's gradient for a client's LoRA adapters from one backward pass of its batch.

DP-SGD clips every sample's gradient. Backpropagating each sample's share of the batch loss on its
own costs one backward of the whole batch per sample, about B times a plain step. The adapters are
nn.Linear layers (peft's lora_A and lora_B), and a linear layer's weight gradient is a sum over
positions of output gradient times input. So the batch's forward keeps each layer's input, and one
backward keeps the gradient that reaches its output. With the batch's first dimension the sample
(decoder layers never mix samples), sample b's gradient is the same sum over b's positions alone.
This is the rule Opacus's grad samplers use for nn.Linear. It is written here because Opacus wraps a
whole model and reads per-sample gradients of a loss, whereas a split step starts its backward from
the packed rows at a cut.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


class LinearSampleGradients:
    """Per-sample gradients of `params`, each the weight or bias of an nn.Linear in `model`.

    Run the batch's forward inside `recording()`, then one backward that reaches the parameters,
    then read `per_sample(samples)`."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self.count = len(params)
        self.owners: list[tuple[int, nn.Linear, str]] = []
        for module in model.modules():
            if isinstance(module, nn.Linear):
                for attr in ("weight", "bias"):
                    parameter = getattr(module, attr)
                    if parameter is not None and id(parameter) in index:
                        self.owners.append((index[id(parameter)], module, attr))
        missing = set(range(self.count)) - {i for i, _, _ in self.owners}
        if missing:
            raise ValueError(f"{len(missing)} of the {self.count} parameters are not an nn.Linear's weight or bias: "
                             "their per-sample gradients cannot be read from one backward")
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.output_grads: dict[nn.Module, torch.Tensor] = {}

    @contextmanager
    def recording(self) -> Iterator["LinearSampleGradients"]:
        """Keep each layer's input and, on the backward that follows, the gradient at its output."""
        self.inputs.clear()
        self.output_grads.clear()

        def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if module in self.inputs:
                raise RuntimeError(f"{type(module).__name__} ran twice in one forward: its per-sample gradient "
                                   "would need both inputs")
            self.inputs[module] = args[0].detach()
            if output.requires_grad:
                output.register_hook(lambda grad, module=module: self.output_grads.__setitem__(module, grad.detach()))

        handles = [module.register_forward_hook(keep) for module in {id(m): m for _, m, _ in self.owners}.values()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def per_sample(self, samples: int) -> list[tuple[torch.Tensor, ...]]:
        """Each of the batch's `samples` gradients for the parameters, in their order (the last
        backward's); a layer the backward never reached has zero gradients. The recorded tensors
        are let go: a reader kept for the next step would otherwise hold this batch's activations."""
        grads: list[list[torch.Tensor | None]] = [[None] * self.count for _ in range(samples)]
        for position, module, attr in self.owners:
            parameter = getattr(module, attr)
            inputs, output_grad = self.inputs.get(module), self.output_grads.get(module)
            if inputs is None or output_grad is None:
                for sample in grads:
                    sample[position] = torch.zeros_like(parameter)
                continue
            if inputs.shape[0] != samples:
                raise ValueError(f"a layer's input has {inputs.shape[0]} rows where the batch has {samples} samples: "
                                 "its first dimension must be the sample")
            inputs = inputs.reshape(samples, -1, inputs.shape[-1]).to(parameter.dtype)
            output_grad = output_grad.reshape(samples, -1, output_grad.shape[-1]).to(parameter.dtype)
            each = (torch.einsum("bto,bti->boi", output_grad, inputs) if attr == "weight"
                    else output_grad.sum(1))
            for sample, value in zip(grads, each, strict=True):
                sample[position] = value
        self.inputs.clear()
        self.output_grads.clear()
        return [tuple(sample) for sample in grads]
