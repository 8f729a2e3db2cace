"""The attacker's networks, shared by the image attacks, and the training loop they share.

- `GridDecoder`: visual rows on their patch grid -> image (SARA's decoder, scaled to
  the profile; also FORA's inverse network and FSHA's decoder);
- `GridDiscriminator`: tells two sets of feature maps apart (FSHA, FORA);
- `TokenPositionPredictor`, `FeatureMAE`: SARA's position predictor and feature-space
  masked autoencoder;
- `mk_mmd`: multi-kernel maximum mean discrepancy (FORA).
"""

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seeded initialisation that leaves the caller's global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _heads(width: int) -> int:
    """The most attention heads (up to 8) that divide `width`."""
    return next(h for h in (8, 4, 2, 1) if width % h == 0)


class GridDecoder(nn.Module):
    """[B, N, D] rows on a g×g patch grid -> [B, 3, H, W] image in [0, 1].

    Transposed convolutions double the grid until it reaches the patch size (then a
    resize covers patch sizes that are not powers of two), halving the width each
    time, and a 3×3 convolution gives the colours (SPEC.md §3's decoder).
    """

    def __init__(self, hidden_size: int, grid: int, image_size: int, width: int = 128) -> None:
        super().__init__()
        self.grid, self.image_size = grid, image_size
        self.project = nn.Linear(hidden_size, width)
        layers: list[nn.Module] = []
        channels = width
        for _ in range(max(0, math.ceil(math.log2(image_size / grid)))):
            out = max(16, channels // 2)
            layers += [nn.ConvTranspose2d(channels, out, 4, stride=2, padding=1), nn.BatchNorm2d(out), nn.GELU()]
            channels = out
        self.upsample = nn.Sequential(*layers)
        self.colour = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, grid_rows: torch.Tensor) -> torch.Tensor:
        batch = grid_rows.shape[0]
        x = self.project(grid_rows).transpose(1, 2).reshape(batch, -1, self.grid, self.grid)
        x = self.upsample(x)
        if x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return torch.sigmoid(self.colour(x))


def place_on_grid(rows: Sequence[torch.Tensor], slots: Sequence[torch.Tensor], num_patches: int) -> torch.Tensor:
    """Rows [k_b, D] at grid slots [k_b] (−1: not placed) -> [B, N, D] with zeros where nothing sits."""
    width = rows[0].shape[-1]
    grid = rows[0].new_zeros(len(rows), num_patches, width)
    for b, (r, s) in enumerate(zip(rows, slots, strict=True)):
        placed = s >= 0
        grid[b, s[placed]] = r[placed]
    return grid


def spread_slots(count: int, num_patches: int) -> torch.Tensor:
    """Where k in-order tokens land when their patches are unknown: spread evenly over the grid.

    With k = N this is the identity; it is the naive attacker's guess for a pruned set.
    """
    return ((torch.arange(count) + 0.5) * num_patches / count).long().clamp(max=num_patches - 1)


class GridDiscriminator(nn.Module):
    """A score per sample for rows on their patch grid [B, N, D]: convolutions see the whole
    feature map, as FSHA's discriminator does, not only each row's marginal distribution."""

    def __init__(self, hidden_size: int, grid: int, width: int = 64) -> None:
        super().__init__()
        self.grid = grid
        self.layers = nn.Sequential(
            nn.Conv2d(hidden_size, width, 3, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(width, width, 3, padding=1), nn.LeakyReLU(0.2),
        )
        self.score = nn.Linear(width, 1)

    def forward(self, grid_rows: torch.Tensor) -> torch.Tensor:
        x = grid_rows.transpose(1, 2).reshape(grid_rows.shape[0], -1, self.grid, self.grid)
        return self.score(self.layers(x).mean((-1, -2))).squeeze(-1)


class TokenPositionPredictor(nn.Module):
    """SARA's TPP: Linear D→d, Transformer encoder ×2, Linear d→N; logits over grid positions per token."""

    def __init__(self, hidden_size: int, num_patches: int, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden_size, width)
        layer = nn.TransformerEncoderLayer(width, _heads(width), 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(width, num_patches)

    def forward(self, rows: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.encoder(self.inp(rows), src_key_padding_mask=padding))


def assign_positions(logits: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """SARA's placement: each token takes its arg-max position if its confidence is at least
    `threshold`; where tokens collide the most confident keeps it, the others are not placed (−1)."""
    probabilities = logits.softmax(-1)
    confidence, position = probabilities.max(-1)
    slots = torch.full_like(position, -1)
    taken: set[int] = set()
    for token in confidence.argsort(descending=True).tolist():
        if confidence[token] >= threshold and int(position[token]) not in taken:
            slots[token] = position[token]
            taken.add(int(position[token]))
    return slots


class FeatureMAE(nn.Module):
    """SARA's feature-space masked autoencoder: grid with zeroed tokens -> the full grid."""

    def __init__(self, hidden_size: int, num_patches: int, layers: int = 4) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.zeros(1, num_patches, hidden_size))
        nn.init.trunc_normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(hidden_size, _heads(hidden_size), 4 * hidden_size, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)

    def forward(self, grid_rows: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.encoder(grid_rows + self.position)))


def mk_mmd(x: torch.Tensor, y: torch.Tensor, scales: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 4.0)) -> torch.Tensor:
    """Multi-kernel MMD² of two samples [n, D], [m, D]: Gaussian kernels at multiples of the median distance."""
    joint = torch.cat([x, y])
    distances = torch.cdist(joint, joint).pow(2)
    bandwidth = distances.detach().median().clamp(min=1e-6)
    kernel = sum(torch.exp(-distances / (bandwidth * s)) for s in scales)
    n = x.shape[0]
    return kernel[:n, :n].mean() + kernel[n:, n:].mean() - 2 * kernel[:n, n:].mean()


def adam_steps(
    parameters: Sequence[nn.Parameter],
    loss_of_batch: Callable[[torch.Tensor], torch.Tensor],
    num_items: int,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress: Callable[[int], None] | None = None,
) -> list[float]:
    """Adam over random minibatches of item indices; returns the loss per step."""
    optimizer = torch.optim.Adam(list(parameters), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = torch.randint(num_items, (min(batch_size, num_items),), generator=generator)
        loss = loss_of_batch(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(1)
    return losses
