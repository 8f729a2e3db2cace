"""FSIM and FSIMc (Zhang et al., IEEE TIP 2011), ported from piq 0.8.0's `piq.fsim`.

Why a port: piq cannot be imported without torchvision (its package init loads the
FID/Inception extractors), and every torchvision wheel on the index pulls a different
torch (a CUDA build) than the one this project pins. piq is Apache-2.0 like this
project; the computation below is piq's — itself a port of the authors' MATLAB
FeatureSIM.m — with the same constants and defaults, and tests/attacks/test_metrics.py
holds it to values piq 0.8.0 computed. Replace it with `piq.fsim` once a matching
torchvision is installable.
"""

import math

import torch
from torch.nn import functional as F

# The paper's constants, for images scaled to [0, 255].
_T_PHASE, _T_GRADIENT, _T_CHROMA, _LAMBDA = 0.85, 160.0, 200.0, 0.03
_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.5959, -0.2746, -0.3213], [0.2115, -0.5227, 0.3112]])


def fsim(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    data_range: float = 1.0,
    chromatic: bool = True,
    scales: int = 4,
    orientations: int = 4,
    min_length: int = 6,
    mult: int = 2,
    sigma_f: float = 0.55,
    delta_theta: float = 1.2,
    k: float = 2.0,
) -> torch.Tensor:
    """Per-image FSIM (FSIMc when `chromatic`) of `x` against `y`, both [B, C, H, W] in [0, data_range]."""
    if x.shape != y.shape or x.ndim != 4:
        raise ValueError(f"fsim needs two [B, C, H, W] tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if chromatic and x.shape[1] != 3:
        raise ValueError(f"chromatic FSIM needs RGB images, got {x.shape[1]} channels")
    x = x.double() / data_range * 255
    y = y.double() / data_range * 255
    pool = max(1, round(min(x.shape[-2:]) / 256))
    x, y = F.avg_pool2d(x, pool), F.avg_pool2d(y, pool)
    if x.shape[1] == 3:
        weights = _YIQ.to(x).t()
        x = torch.matmul(x.permute(0, 2, 3, 1), weights).permute(0, 3, 1, 2)
        y = torch.matmul(y.permute(0, 2, 3, 1), weights).permute(0, 3, 1, 2)
    x_lum, y_lum = x[:, :1], y[:, :1]
    filters = _log_gabor_filters(x_lum.shape[-2:], scales, orientations, min_length, mult, sigma_f, delta_theta, x)
    pc_x = _phase_congruency(x_lum, filters, scales, orientations, k)
    pc_y = _phase_congruency(y_lum, filters, scales, orientations, k)
    scharr = torch.tensor([[[-3.0, 0.0, 3.0], [-10.0, 0.0, 10.0], [-3.0, 0.0, 3.0]]]).to(x) / 16
    kernels = torch.stack([scharr, scharr.transpose(-1, -2)])
    score = (
        _similarity(_gradient_magnitude(x_lum, kernels), _gradient_magnitude(y_lum, kernels), _T_GRADIENT)
        * _similarity(pc_x, pc_y, _T_PHASE)
    )
    pc_max = torch.maximum(pc_x, pc_y)
    score = score * pc_max
    if chromatic:
        chroma = _similarity(x[:, 1:2], y[:, 1:2], _T_CHROMA) * _similarity(x[:, 2:], y[:, 2:], _T_CHROMA)
        score = score * chroma.abs() ** _LAMBDA
    return (score.sum(dim=(1, 2, 3)) / pc_max.sum(dim=(1, 2, 3))).float()


def _similarity(a: torch.Tensor, b: torch.Tensor, constant: float) -> torch.Tensor:
    return (2 * a * b + constant) / (a**2 + b**2 + constant)


def _gradient_magnitude(x: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
    grads = F.conv2d(x, kernels, padding=kernels.shape[-1] // 2)
    return grads.pow(2).sum(dim=1, keepdim=True).sqrt()


def _ifftshift(x: torch.Tensor) -> torch.Tensor:
    return torch.roll(x, [-(size // 2) for size in x.shape], tuple(range(x.ndim)))


def _centred_grid(size: int, like: torch.Tensor) -> torch.Tensor:
    if size % 2:
        return torch.arange(-(size - 1) / 2, size / 2).to(like) / (size - 1)
    return torch.arange(-size / 2, size / 2).to(like) / size


def _log_gabor_filters(shape, scales, orientations, min_length, mult, sigma_f, delta_theta, like) -> torch.Tensor:
    """[1, orientations·scales, H, W] frequency-domain filters (orientation-major, as piq stacks them)."""
    height, width = shape
    grid_x, grid_y = torch.meshgrid(_centred_grid(height, like), _centred_grid(width, like), indexing="ij")
    radius = torch.sqrt(grid_x**2 + grid_y**2)
    theta = torch.atan2(-grid_y, grid_x)
    # The widest low-pass that falls to zero at the borders (Kovesi's lowpassfilter, cutoff 0.45, order 15).
    low_pass = _ifftshift(1.0 / (1.0 + (radius / 0.45) ** 30))
    radius, theta = _ifftshift(radius), _ifftshift(theta)
    radius[0, 0] = 1  # log(0) would poison the zero-frequency term, which is zeroed below anyway
    radial = []
    for scale in range(scales):
        centre = 1.0 / (min_length * mult**scale)
        band = torch.exp(-torch.log(radius / centre) ** 2 / (2 * math.log(sigma_f) ** 2)) * low_pass
        band[0, 0] = 0
        radial.append(band)
    theta_sigma = math.pi / (orientations * delta_theta)
    angular = []
    for orientation in range(orientations):
        angle = orientation * math.pi / orientations
        sin_diff = torch.sin(theta) * math.cos(angle) - torch.cos(theta) * math.sin(angle)
        cos_diff = torch.cos(theta) * math.cos(angle) + torch.sin(theta) * math.sin(angle)
        angular.append(torch.exp(-torch.atan2(sin_diff, cos_diff).abs() ** 2 / (2 * theta_sigma**2)))
    return (torch.stack(angular).repeat_interleave(scales, 0) * torch.stack(radial).repeat(orientations, 1, 1))[None]


def _phase_congruency(x: torch.Tensor, filters: torch.Tensor, scales: int, orientations: int, k: float) -> torch.Tensor:
    """Kovesi's phase congruency (PC_2 measure) with his noise compensation, [B, 1, H, W]."""
    eps = torch.finfo(x.dtype).eps
    batch, _, height, width = x.shape
    responses = torch.view_as_real(torch.fft.ifft2(torch.fft.fft2(x) * filters))
    responses = responses.view(batch, orientations, scales, height, width, 2)
    even, odd = responses[..., 0], responses[..., 1]
    amplitude = responses.pow(2).sum(-1).sqrt()
    sum_even, sum_odd = even.sum(2, keepdim=True), odd.sum(2, keepdim=True)
    norm = torch.sqrt(sum_even**2 + sum_odd**2) + eps
    mean_even, mean_odd = sum_even / norm, sum_odd / norm
    energy = (even * mean_even + odd * mean_odd - (even * mean_odd - odd * mean_even).abs()).sum(2, keepdim=True)
    # Noise: the smallest scale's squared response is Rayleigh-distributed under Gaussian
    # noise, so its median gives the noise power, and from it the noise energy threshold.
    filter_power = (filters.view(1, orientations, scales, height, width)[:, :, :1] ** 2).sum((-2, -1), keepdim=True)
    smallest = amplitude[:, :, :1].reshape(batch, orientations, 1, 1, height * width)
    noise_power = -(smallest**2).median(-1, keepdim=True).values / math.log(0.5) / filter_power
    spatial = (torch.fft.ifft2(filters).real * math.sqrt(height * width)).view(1, orientations, scales, height, width)
    sum_an2 = (spatial**2).sum(2, keepdim=True).sum((-1, -2), keepdim=True)
    sum_ai_aj = torch.zeros(batch, orientations, 1, height, width, dtype=x.dtype)
    for scale in range(scales - 1):
        sum_ai_aj = sum_ai_aj + (spatial[:, :, scale : scale + 1] * spatial[:, :, scale + 1 :]).sum(2, keepdim=True)
    sum_ai_aj = sum_ai_aj.sum((-1, -2), keepdim=True)
    tau = torch.sqrt((2 * noise_power * sum_an2 + 4 * noise_power * sum_ai_aj) / 2)
    threshold = (tau * math.sqrt(math.pi / 2) + k * torch.sqrt((2 - math.pi / 2) * tau**2)) / 1.7
    energy = torch.clamp(energy - threshold, min=0)
    return ((energy.sum((1, 2)) + eps) / (amplitude.sum((1, 2)) + eps)).unsqueeze(1)
