"""PriPert (seed 001, §6.2): perturb the cut activation where the front's inverse amplifies it most.

A perturbation δ of the activation z = F_C(x) moves an attacker's inversion by
Δ = J̄⁻¹ δ, with J̄ = ∫₀¹ J(x + tΔ) dt the front's Jacobian averaged over the path
from the input to the input of the perturbed activation (the mean-value form of the
paper's path integral, exact for the secant; the paper sums inverse Jacobians at the
path's points, which agrees to first order). The direction that ‖Δ‖ grows fastest in
is the leading right singular vector u of J̄⁻¹, i.e. the left singular vector of J̄ with
the smallest singular value σ. Computing it needs neither J̄ nor its inverse: Adam
minimises each sample's Rayleigh quotient ‖J̄ᵀu‖² / ‖u‖² with one vector-Jacobian
product (autograd, through each path point's one kept forward graph) and one
Jacobian-vector product (a one-sided difference of the front) per iteration (the front's
Jacobian is block-diagonal across samples). `iterations` bounds the work: a few find a
direction deep in the low-σ subspace rather than the exact minimum (metric
`inverse_gain`: the mean 1/σ reached), and the client's cost grows with them
(benchmarks/defense_overhead.py).

- `steps` (1–3, default 2): points t = 0, …, 1 on the path; 1 evaluates J at the input
  only, 2 adds the perturbed end (the paper's ∇F⁻¹(z) + ∇F⁻¹(ẑ)), 3 the midpoint. The
  perturbed end comes from the one-point estimate Δ ≈ (u·δ) J̄ᵀu / σ².
- variant "l2" (p = q = 2): z + μ·u per sample, μ = `budget` · ‖z_b‖ (the paper's μ is
  absolute; relative to the sample's norm it means the same on every profile).
- variant "l0" (p = 2, q = 0): each sample zeroes a `sparsity` share of its elements.
  Zeroing element e is the perturbation −z_e·e_e, which moves the inversion by
  −z_e·J̄⁻¹e_e; its part along the leading direction is −z_e·u_e / σ, so the share
  zeroed are the elements with the largest z_e·u_e of the sign whose sum is larger
  (`keep`="greedy": the rank-one greedy solution of max ‖J̄⁻¹δ‖ over such δ). The
  paper's text (its Eq. 5 is lost) keeps "the top-k% elements of δ(∇F⁻¹(z) + ∇F⁻¹(ẑ))";
  read literally — keep the largest |(J̄ᵀu)_e|, the input displacement J̄⁻¹u = J̄ᵀu / σ²
  paired with activation elements through the residual stream — it is `keep`="sensitive".
  On the tiny front's white-box linear inverter, greedy moved the inversion further
  than random zeroing at sparsity 0.1 and 0.5 (about as far at 0.9), the literal
  reading no further than random (tests/privacy/test_defenses.py checks the default).

The direction is data for the backward pass: gradients flow through z·mask + μ·u as
through any fixed mask and shift. The search starts from the step's seeded
random direction, so a recomputed front sends the same payload.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from privacy.base import ACTIVATION, Defended, Defense, DefenseSeed, OptionError, Payload, register_defense
from privacy.sparsification import keep_largest

VARIANTS = ("l0", "l2")
KEEP = ("greedy", "sensitive")
# Finite-difference step, relative to the input's norm over the direction's.
_FD_SCALE = 1e-3


@dataclass
class PriPertOptions:
    # "l0": keep the most sensitive elements, zero the rest; "l2": add the leading direction.
    variant: str = "l0"
    # l0: share of each sample's elements zeroed (the paper's grid: 0.1, 0.3, 0.5, 0.7, 0.9).
    sparsity: float = 0.5
    # l2: the perturbation's norm, relative to each sample's activation norm.
    budget: float = 0.5
    # Points on the path between the activation and its perturbed estimate (1–3).
    steps: int = 2
    # Adam steps on the Rayleigh quotient per path evaluation, and their learning rate.
    iterations: int = 16
    lr: float = 0.1
    # l0: which elements survive: "greedy" zeroes those that move the inversion furthest along
    # the leading direction; "sensitive" keeps the largest |J̄ᵀu| (the paper's text read literally).
    keep: str = "greedy"

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise OptionError("variant", self.variant, ", ".join(VARIANTS))
        if not 0 <= self.sparsity < 1:
            raise OptionError("sparsity", self.sparsity, "a share in [0, 1)")
        if not self.budget > 0:
            raise OptionError("budget", self.budget, "> 0 (relative to the activation's norm)")
        if self.steps not in (1, 2, 3):
            raise OptionError("steps", self.steps, "1, 2 or 3")
        if self.iterations < 1:
            raise OptionError("iterations", self.iterations, ">= 1")
        if not self.lr > 0:
            raise OptionError("lr", self.lr, "> 0")
        if self.keep not in KEEP:
            raise OptionError("keep", self.keep, ", ".join(KEEP))


class PathJacobian:
    """J̄ and J̄ᵀ as operators on packed rows, averaged over `points` (input rows on the path).

    Each point's forward runs once: its graph is kept for every vector-Jacobian product, and
    its output is the base of the one-sided differences that give the Jacobian-vector products.
    """

    def __init__(self, front: Callable[[torch.Tensor], torch.Tensor], points: list[torch.Tensor]) -> None:
        self.front = front
        self.inputs = [point.detach().clone().requires_grad_() for point in points]
        with torch.enable_grad():
            self.outputs = [front(x) for x in self.inputs]

    def transpose_times(self, u: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(self.inputs[0])
        for x, out in zip(self.inputs, self.outputs, strict=True):
            (grad,) = torch.autograd.grad(out, x, u, retain_graph=True)
            total += grad
        return total / len(self.inputs)

    @torch.no_grad()
    def times(self, v: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(self.inputs[0])
        for x, out in zip(self.inputs, self.outputs, strict=True):
            eps = _FD_SCALE * float(x.norm()) / max(float(v.norm()), 1e-30)
            total += (self.front(x.detach() + eps * v) - out.detach()) / eps
        return total / len(self.inputs)


class _Samples:
    """Per-sample reductions over packed rows."""

    def __init__(self, lengths: torch.Tensor, rows: torch.Tensor) -> None:
        self.count = lengths.numel()
        self.owner = torch.repeat_interleave(torch.arange(self.count, device=rows.device), lengths.to(rows.device, torch.long))
        self.elements = lengths.to(rows.device, rows.dtype) * rows.shape[-1]

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.count, device=a.device, dtype=a.dtype).index_add_(0, self.owner, (a * b).sum(-1))

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        return values[self.owner].unsqueeze(-1)

    def split(self, a: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(a, torch.bincount(self.owner, minlength=self.count).tolist()))

    def normalise(self, a: torch.Tensor) -> torch.Tensor:
        return a / self.per_row(self.dot(a, a).sqrt().clamp_min(1e-30))


def leading_inverse_direction(
    jacobian: PathJacobian, samples: _Samples, start: torch.Tensor, iterations: int, lr: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample, a unit direction u where J̄⁻¹ is largest, J̄ᵀu, and σ² = ‖J̄ᵀu‖² (its Rayleigh quotient).

    Adam on each sample's Rayleigh quotient ‖J̄ᵀu‖² / ‖u‖², whose gradient 2(J̄J̄ᵀu − σ²u) / ‖u‖²
    costs one vector-Jacobian and one Jacobian-vector product; Adam's per-element steps
    reach far lower quotients than power iteration in the same number of products when
    the front is ill-conditioned (on the tiny front, condition number ~10³).
    """
    # Unit RMS per element, so `lr` means the same for every sample size.
    u = torch.nn.Parameter(samples.normalise(start) * samples.per_row(samples.elements.sqrt()))
    optimizer = torch.optim.Adam([u], lr=lr)
    for _ in range(iterations):
        v = u.detach()
        back = jacobian.transpose_times(v)
        norm2 = samples.dot(v, v)
        quotient = samples.dot(back, back) / norm2
        u.grad = 2 * (jacobian.times(back) - samples.per_row(quotient) * v) / samples.per_row(norm2)
        optimizer.step()
    direction = samples.normalise(u.detach())
    back = jacobian.transpose_times(direction)
    return direction, back, samples.dot(back, back)


class PriPert(Defense):
    name = "pripert"
    stage = ACTIVATION
    Options = PriPertOptions
    strength = "sparsity"
    random = True

    @classmethod
    def strength_option(cls, options: PriPertOptions) -> str:
        return "budget" if options.variant == "l2" else cls.strength

    def direction(self, payload: Payload, seed: DefenseSeed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u, J̄ᵀu, σ²) on the path of `steps` points: the leading direction of J̄⁻¹ per sample."""
        payload.needs(self.name, "inputs", "front")
        o = self.options
        z, x = payload.rows.detach(), payload.inputs.detach()
        samples = _Samples(payload.lengths, z)
        start = torch.randn(z.shape, generator=seed.generator(self.name), dtype=torch.float32).to(z.device, z.dtype)
        start = samples.normalise(start)
        jacobian = PathJacobian(payload.front, [x])
        u, back, sigma2 = leading_inverse_direction(jacobian, samples, start, o.iterations, o.lr)
        if o.steps > 1:
            delta = self._perturbation(z, u, back, samples)
            # The input of the perturbed activation, from the one-point estimate Δ ≈ (u·δ) J̄ᵀu / σ².
            shift = samples.per_row(samples.dot(u, delta) / sigma2.clamp_min(1e-30)) * back
            points = [x + t * shift for t in torch.linspace(0, 1, o.steps).tolist()]
            jacobian = PathJacobian(payload.front, points)
            u, back, sigma2 = leading_inverse_direction(jacobian, samples, u, o.iterations, o.lr)
        return u, back, sigma2

    def _perturbation(self, z: torch.Tensor, u: torch.Tensor, back: torch.Tensor, samples: _Samples) -> torch.Tensor:
        """δ the variant applies for direction u (J̄ᵀu = `back`)."""
        if self.options.variant == "l2":
            return self.options.budget * samples.per_row(samples.dot(z, z).sqrt()) * u
        return self._mask(z, u, back, samples) * z - z

    def _mask(self, z: torch.Tensor, u: torch.Tensor, back: torch.Tensor, samples: _Samples) -> torch.Tensor:
        if self.options.keep == "sensitive":
            score = back.abs()
        else:
            # Zeroing element e moves the inversion by −z_e·J̄⁻¹e_e, whose part along the leading
            # direction is −z_e·u_e / σ: zero the largest z_e·u_e of the sign that sums larger.
            contribution = z * u
            sign = torch.where(samples.dot(contribution.clamp_min(0), torch.ones_like(z))
                               >= samples.dot((-contribution).clamp_min(0), torch.ones_like(z)), 1.0, -1.0)
            score = -samples.per_row(sign.to(z.dtype)) * contribution
        masks = [keep_largest(part, self.options.sparsity) for part in samples.split(score)]
        return torch.cat(masks).to(z.dtype)

    def apply(self, payload: Payload, seed: DefenseSeed) -> Defended:
        o = self.options
        u, back, sigma2 = self.direction(payload, seed)
        samples = _Samples(payload.lengths, payload.rows)
        metrics = {"inverse_gain": float((1 / sigma2.clamp_min(1e-30).sqrt()).mean())}
        if o.variant == "l2":
            shift = self._perturbation(payload.rows.detach(), u, back, samples)
            return Defended(payload.rows + shift.detach(), metrics=metrics)
        mask = self._mask(payload.rows.detach(), u, back, samples)
        return Defended(payload.rows * mask, metrics=metrics | {"zeroed_share": float(1 - mask.mean())})


register_defense(PriPert)
