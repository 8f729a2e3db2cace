"""PAF, the perturbation amplification factor (seed 001, §5.1–5.2): how hard a sub-layer is to invert.

A sub-layer y = f(x) (a norm, a projection, the activation, attention) has the Jacobian
J = ∂y/∂x ∈ R^{m×n} at a real input x, with singular values s_1 ≥ s_2 ≥ … (left/right
singular vectors u_i, v_i) and ‖J‖₂ = s_1. The paper's definition survives only as

    PAF := E_{δ~N(0,I)} Σ_i | ‖J‖₂ cos θ_i / sqrt(σ_i + 1) |,

with θ_i and σ_i lost from the text. Its derivation says which reading fits: an attacker
matches a perturbed output y + δ = f(x̂); the linearised, regularised (Gauss–Newton /
Levenberg–Marquardt) inversion moves the input by Δ = (JᵀJ + I)⁻¹ Jᵀδ =
Σ_i s_i/(s_i² + 1) (u_iᵀδ) v_i, and the paper's bound

    ‖Δ‖² ≤ Σ_i ( ‖δJ‖₂ cos θ_i / sqrt(σ_i + 1) )²

holds exactly when σ_i = s_i² (the eigenvalues of JᵀJ, i.e. the non-zero ones of JJᵀ) and
θ_i is the angle between δJ (= Jᵀδ, the perturbation pulled back to the input) and v_i:
then ‖Jᵀδ‖ cos θ_i = s_i u_iᵀδ and each term s_i u_iᵀδ / sqrt(s_i² + 1) bounds
s_i u_iᵀδ / (s_i² + 1). PAF replaces ‖δJ‖₂ by ‖J‖₂ and sums absolute values. That is the
default here (`theta="pullback"`, `sigma="eig"`, `reduce="sum"`); the other readings are
options:

- `theta="output"`: θ_i is the angle between δ itself and u_i, i over all m output
  directions (eigenvectors of JJᵀ; the m − rank directions the layer cannot produce get
  σ_i = 0). Under this reading a direction the layer annihilates counts most (weight
  ‖J‖₂); under the default it counts nothing (the regularised inversion filters that noise out).
- `sigma="sv"`: σ_i = s_i (the singular values instead of their squares).
- `reduce="norm"`: sqrt(Σ_i (…)²), the bound on ‖Δ‖ itself rather than the sum of |terms|.

Properties of the default, which tests/privacy/test_paf.py holds it to: PAF depends on the
spectrum only (orthogonal maps of the same size agree); for the identity of size n it is
n·κ_n/√2 with κ_n = E|c_1| for c uniform on the unit sphere (≈ sqrt(n/π)), so PAF grows
like sqrt(width) and layers of different widths compare with that in mind; it grows with a
scale a·J; a zero singular value removes its term. max-PAF, the worst direction, has the
closed form (Cauchy–Schwarz over the unit vector cos θ) ‖J‖₂ · sqrt(Σ_{s_i>0} 1/(σ_i + 1)),
attained at δ* ∝ Σ_i u_i / (s_i sqrt(σ_i + 1)) (`worst_direction`); with `reduce="norm"` it
is ‖J‖₂ / sqrt(σ_min + 1). "s_i > 0" means above `rank_rtol`·s_1 (1e-4: a float32 Jacobian's
singular values are only accurate to about 1e-6·s_1, so smaller ones are rounding). The sup is
set by the smallest kept singular value, since a unit cos θ may put all its weight there:
RMSNorm's Jacobian (g/r)(I − x̂x̂ᵀ), r² = mean(x²) + ε, has a radial singular value
(g/r)·ε/r² that only ε keeps from zero, so a token whose mean square is within about four
orders of magnitude of ε gets max-PAF ≈ ‖J‖₂ (the report's worst-token column shows it).

Because PAF depends only on the spectrum, the Monte-Carlo estimate (`directions` draws, 100
as in the paper) samples the coordinates a = U_rᵀδ ~ N(0, I_r) (default) or the unit vector
c = Uᵀδ/‖δ‖ (output reading) directly; `direction_paf` evaluates the definition literally
from a Jacobian's singular vectors, and the tests check the two agree.

On a model (`decoder_paf`), forward pre-hooks on each decoder layer's sub-layers capture
their real inputs for a batch of samples; per-token sub-layers (norms, projections, the
activation) get one D×D-sized Jacobian per sampled token (torch.func.vmap over jacrev; an
affine map's Jacobian is its weight, so one token stands for all), attention a Jacobian of
one output token with respect to every input token of its sample (m = D, n = T·D). Residual
connections are left out, as in the paper (the identity). Tokens are drawn among each
sample's non-padded positions (optionally only where a token mask is true, e.g. the text),
`tokens_per_sample` each (0: all). `whole_front_paf` takes the front F_C in one piece instead:
one output row at the cut against every input row, residuals included. Jacobians are taken
with the parameters frozen and SDPA on its math backend (same numbers; functorch batches it).
This module imports only torch and vlm, so anything holding decoder layers and their inputs
can use it; `qpriv-privacy paf` (sims/privacy_cli.py) runs it on a profile's model.
"""

import math
import warnings
from contextlib import contextmanager
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from vlm.segments import llava_parts, run_decoder_layers

THETAS = ("pullback", "output")
SIGMAS = ("eig", "sv")
REDUCES = ("sum", "norm")
# A Llama/Qwen decoder layer's sub-layers in forward order (names within the layer);
# "self_attn" is the attention block as a whole (q/k/v, rotary, softmax mixing, o).
SUBLAYERS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.act_fn",
    "mlp.down_proj",
)
ATTENTION = "self_attn"


@dataclass(frozen=True)
class PAFOptions:
    # Monte-Carlo draws of δ per Jacobian (the paper: 100).
    directions: int = 100
    theta: str = "pullback"
    sigma: str = "eig"
    reduce: str = "sum"
    # Singular values at most this share of ‖J‖₂ count as zero (rank).
    rank_rtol: float = 1e-4
    # Tokens drawn per sample (0: every non-padded token).
    tokens_per_sample: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for key, value, allowed in (("theta", self.theta, THETAS), ("sigma", self.sigma, SIGMAS),
                                    ("reduce", self.reduce, REDUCES)):
            if value not in allowed:
                raise ValueError(f"PAF {key}={value!r}; allowed: {allowed}")
        if self.directions < 1:
            raise ValueError(f"PAF directions={self.directions} must be >= 1")
        if self.tokens_per_sample < 0:
            raise ValueError(f"PAF tokens_per_sample={self.tokens_per_sample} must be >= 0 (0: all tokens)")
        if not 0 <= self.rank_rtol < 1:
            raise ValueError(f"PAF rank_rtol={self.rank_rtol} must be in [0, 1)")


def unit_sphere_abs_mean(dim: int) -> float:
    """κ_d = E|c_1| for c uniform on the unit sphere of R^d: Γ(d/2) / (√π Γ((d+1)/2))."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


# -- PAF of a spectrum -----------------------------------------------------------------------------
def _sigma(s: torch.Tensor, options: PAFOptions) -> torch.Tensor:
    return s**2 if options.sigma == "eig" else s


def _output_spectrum(s: torch.Tensor, rows: int) -> torch.Tensor:
    """Singular values padded with zeros to the m output directions (eigenvalues of JJᵀ)."""
    return torch.nn.functional.pad(s, (0, max(0, rows - s.shape[-1])))[..., :rows]


def _terms(s: torch.Tensor, cos: torch.Tensor, options: PAFOptions) -> torch.Tensor:
    """PAF of each direction from the spectrum s [..., r] and its cosines cos θ [..., N, r] -> [..., N]."""
    norm = s.max(-1, keepdim=True).values.unsqueeze(-2)
    weighted = norm * cos / torch.sqrt(_sigma(s, options).unsqueeze(-2) + 1)
    if options.reduce == "sum":
        return weighted.abs().sum(-1)
    return weighted.pow(2).sum(-1).sqrt()


def _kept(s: torch.Tensor, options: PAFOptions) -> torch.Tensor:
    """s with the singular values below the rank tolerance set to zero."""
    return torch.where(s > options.rank_rtol * s.max(-1, keepdim=True).values, s, torch.zeros_like(s))


def spectrum_paf(
    singular_values: torch.Tensor, rows: int, options: PAFOptions, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """PAF of Jacobians given by their singular values [..., r] (r = min(m, n)) and m = `rows`.

    Returns per Jacobian: `paf` (the Monte-Carlo mean over `options.directions` draws),
    `mc_std` (the draws' standard deviation), `max_paf` (closed form) and `norm` (‖J‖₂).
    """
    s = _kept(singular_values.double(), options)
    batch = s.shape[:-1]
    n = options.directions
    if options.theta == "pullback":
        a = torch.randn(*batch, n, s.shape[-1], generator=generator, dtype=torch.float64)
        pulled = s.unsqueeze(-2) * a  # (Jᵀδ)·v_i = s_i u_iᵀδ
        cos = torch.nan_to_num(pulled / pulled.norm(dim=-1, keepdim=True))
        spectrum = s
    else:
        spectrum = _output_spectrum(s, rows)
        g = torch.randn(*batch, n, rows, generator=generator, dtype=torch.float64)
        cos = g / g.norm(dim=-1, keepdim=True)
    values = _terms(spectrum, cos, options)
    return {
        "paf": values.mean(-1),
        "mc_std": values.std(-1) if n > 1 else torch.zeros(batch, dtype=torch.float64),
        "max_paf": max_paf_of_spectrum(singular_values, rows, options),
        "norm": s.max(-1).values,
    }


def _max_weights(s: torch.Tensor, rows: int, options: PAFOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights ‖J‖₂/sqrt(σ_i+1) of the directions a unit cos θ may use, and which those are."""
    s = _kept(s.double(), options)
    spectrum = s if options.theta == "pullback" else _output_spectrum(s, rows)
    norm = s.max(-1, keepdim=True).values
    weights = norm / torch.sqrt(_sigma(spectrum, options) + 1)
    usable = spectrum > 0 if options.theta == "pullback" else torch.ones_like(spectrum, dtype=torch.bool)
    return weights, usable


def max_paf_of_spectrum(singular_values: torch.Tensor, rows: int, options: PAFOptions) -> torch.Tensor:
    """max over unit δ of the PAF term sum: ‖w‖₂ (sum) or max w (norm) over the usable directions."""
    weights, usable = _max_weights(singular_values, rows, options)
    weights = torch.where(usable, weights, torch.zeros_like(weights))
    if options.reduce == "sum":
        return weights.pow(2).sum(-1).sqrt()
    return weights.max(-1).values


# -- PAF of a Jacobian, literally ------------------------------------------------------------------
def jacobian_paf(jacobian: torch.Tensor, options: PAFOptions = PAFOptions(),
                 generator: torch.Generator | None = None) -> dict[str, float]:
    """PAF statistics of one Jacobian [m, n] (spectrum_paf on its singular values)."""
    s = torch.linalg.svdvals(jacobian.double())
    return {k: float(v) for k, v in spectrum_paf(s, jacobian.shape[0], options, generator).items()}


def direction_paf(jacobian: torch.Tensor, delta: torch.Tensor, options: PAFOptions = PAFOptions()) -> torch.Tensor:
    """The PAF term sum for output perturbations δ [..., m], from J's singular vectors (the definition
    read directly, no shortcut): θ_i between δJ and v_i (pullback) or between δ and u_i (output)."""
    J = jacobian.double()
    delta = delta.double()
    U, s, Vh = torch.linalg.svd(J, full_matrices=True)
    s = _kept(s, options)
    norm = s.max()
    if options.theta == "pullback":
        pulled = delta @ J  # δJ, [..., n]
        rank = int((s > 0).sum())
        cos = torch.nan_to_num((pulled @ Vh[:rank].T) / pulled.norm(dim=-1, keepdim=True))
        sigma = _sigma(s[:rank], options)
    else:
        cos = (delta @ U) / delta.norm(dim=-1, keepdim=True)
        sigma = _sigma(_output_spectrum(s, J.shape[0]), options)
    weighted = norm * cos / torch.sqrt(sigma + 1)
    return weighted.abs().sum(-1) if options.reduce == "sum" else weighted.pow(2).sum(-1).sqrt()


def worst_direction(jacobian: torch.Tensor, options: PAFOptions = PAFOptions()) -> torch.Tensor:
    """A unit output perturbation δ [m] attaining max-PAF."""
    J = jacobian.double()
    U, s, _ = torch.linalg.svd(J, full_matrices=True)
    weights, usable = _max_weights(s, J.shape[0], options)
    weights = torch.where(usable, weights, torch.zeros_like(weights))
    if options.reduce == "norm":
        coefficients = torch.zeros_like(weights)
        coefficients[int(weights.argmax())] = 1.0
    elif options.theta == "pullback":
        # cos θ ∝ w needs u_iᵀδ ∝ w_i / s_i.
        kept = _kept(s, options)
        coefficients = torch.where(usable, weights / kept.clamp_min(torch.finfo(torch.float64).tiny),
                                   torch.zeros_like(weights))
    else:
        coefficients = weights
    delta = U[:, : coefficients.shape[0]] @ coefficients
    return delta / delta.norm()


# -- Jacobians of sub-layers on real inputs --------------------------------------------------------
def is_affine(module: nn.Module) -> bool:
    """A linear layer (plain, or peft's LoRA wrapper of one in eval mode): its Jacobian is constant."""
    if isinstance(module, nn.Linear):
        return True
    base = getattr(module, "base_layer", None)
    return isinstance(base, nn.Linear) and not module.training


def token_jacobians(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Per-token Jacobians [k, m, n] of a per-token module at inputs [k, n]."""

    def one(x: torch.Tensor) -> torch.Tensor:
        return module(x.reshape(1, 1, -1)).reshape(-1)

    try:
        return torch.func.vmap(torch.func.jacrev(one))(inputs)
    except (RuntimeError, NotImplementedError):  # an op without a batching rule: one token at a time
        return torch.stack([torch.autograd.functional.jacobian(one, x) for x in inputs])


def _slice_batch(value: Any, sample: int, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value[sample : sample + 1]
    if isinstance(value, tuple):
        return tuple(_slice_batch(v, sample, batch) for v in value)
    return value


def attention_jacobians(
    attention: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], sample: int, positions: torch.Tensor
) -> torch.Tensor:
    """Jacobians [k, D, T·D] of attention's output rows `positions` of sample `sample` with respect to
    every input row of that sample; `hidden` [B, T, D] and `kwargs` are what the layer passed it."""
    batch = hidden.shape[0]
    sample_kwargs = {key: _slice_batch(value, sample, batch) for key, value in kwargs.items()}
    x = hidden[sample]

    def rows(x: torch.Tensor) -> torch.Tensor:
        out = attention(hidden_states=x.unsqueeze(0), **sample_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out[0, positions]

    with warnings.catch_warnings():
        # CPU flash attention's backward has no batching rule: functorch falls back to a loop, correctly.
        warnings.filterwarnings("ignore", message=".*batching rule.*", category=UserWarning)
        try:
            jac = torch.func.jacrev(rows)(x)
        except (RuntimeError, NotImplementedError):
            jac = torch.autograd.functional.jacobian(rows, x)
    return jac.reshape(positions.numel(), x.shape[-1], -1)


# -- a decoder's sub-layers ------------------------------------------------------------------------
@dataclass
class SubLayerPAF:
    """PAF of one sub-layer over the sampled tokens: mean and std across tokens of each token's
    Monte-Carlo estimate, the estimate's mean standard error, max-PAF and ‖J‖₂."""

    layer: int
    name: str
    kind: str
    shape: tuple[int, int]
    tokens: int
    paf_mean: float
    paf_std: float
    mc_stderr: float
    max_paf_mean: float
    max_paf_std: float
    max_paf_max: float
    norm_mean: float

    @property
    def label(self) -> str:
        return f"{self.layer}.{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape), "label": self.label}


def sublayer_kind(name: str) -> str:
    if name.startswith("front["):
        return "front"
    last = name.rsplit(".", 1)[-1]
    if "norm" in last:
        return "norm"
    if last.endswith("_proj"):
        return "projection"
    if last == ATTENTION:
        return "attention"
    if last.startswith("act"):
        return "activation"
    return "other"


def _summary(layer: int, name: str, shape: tuple[int, int], stats: dict[str, torch.Tensor], directions: int
             ) -> SubLayerPAF:
    paf, max_paf = stats["paf"], stats["max_paf"]
    tokens = paf.numel()
    spread = (lambda v: float(v.std())) if tokens > 1 else (lambda v: 0.0)
    return SubLayerPAF(
        layer=layer, name=name, kind=sublayer_kind(name), shape=shape, tokens=tokens,
        paf_mean=float(paf.mean()), paf_std=spread(paf),
        mc_stderr=float((stats["mc_std"] / math.sqrt(directions)).mean()),
        max_paf_mean=float(max_paf.mean()), max_paf_std=spread(max_paf), max_paf_max=float(max_paf.max()),
        norm_mean=float(stats["norm"].mean()),
    )


def sample_tokens(valid: torch.Tensor, per_sample: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Positions drawn (sorted, without replacement) among each sample's valid ones; 0: all valid."""
    chosen = []
    for row in valid.bool():
        positions = row.nonzero().flatten()
        if positions.numel() == 0:
            raise ValueError("a sample without a single valid (non-padded) token")
        if per_sample and per_sample < positions.numel():
            positions = positions[torch.randperm(positions.numel(), generator=generator)[:per_sample]].sort().values
        chosen.append(positions)
    return chosen


def capture_inputs(
    layers: Sequence[nn.Module], names: Iterable[str], forward: Callable[[], Any]
) -> dict[tuple[int, str], tuple[tuple, dict]]:
    """The (args, kwargs) each named sub-layer of each layer was called with while `forward()` ran."""
    names = list(names)
    captured: dict[tuple[int, str], tuple[tuple, dict]] = {}
    handles = []
    try:
        for index, layer in enumerate(layers):
            modules = dict(layer.named_modules())
            missing = [name for name in names if name not in modules]
            if missing:
                raise ValueError(
                    f"decoder layer {index} ({type(layer).__name__}) has no sub-layer {missing}; "
                    f"it has {sorted(n for n in modules if n)}"
                )
            for name in names:
                def hook(module, args, kwargs, key=(index, name)):
                    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
                    captured.setdefault(key, (
                        tuple(detach(a) for a in args),
                        {k: tuple(detach(x) for x in v) if isinstance(v, tuple) else detach(v)
                         for k, v in kwargs.items()},
                    ))
                handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _input_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    if args:
        return args[0], {k: v for k, v in kwargs.items() if k != "hidden_states"}
    rest = dict(kwargs)
    return rest.pop("hidden_states"), rest


def decoder_paf(
    layers: Sequence[nn.Module],
    forward: Callable[[], Any],
    valid: torch.Tensor,
    options: PAFOptions = PAFOptions(),
    *,
    sublayers: Sequence[str] = SUBLAYERS,
    first_index: int = 0,
    progress: bool = False,
) -> list[SubLayerPAF]:
    """PAF of every named sub-layer of `layers`, on the inputs they see while `forward()` runs them.

    `valid` [B, T] marks the non-padded tokens of the batch `forward` runs (padding is no real
    input); `first_index` numbers the first of `layers` in the report.
    """
    captured = capture_inputs(layers, sublayers, forward)
    positions = sample_tokens(valid, options.tokens_per_sample, torch.Generator().manual_seed(options.seed))
    jobs = [(i, name) for i in range(len(layers)) for name in sublayers]
    with jacobian_mode(layers):
        return [
            _sublayer_paf(layers[index], index, name, number, captured, positions, options, first_index)
            for number, (index, name) in enumerate(tqdm(jobs, desc="PAF sub-layers", disable=not progress))
        ]


@contextmanager
def jacobian_mode(modules: Iterable[nn.Module]):
    """Jacobians with respect to the inputs only (the modules' parameters stop requiring grad, and get
    their flags back after), and SDPA on its math backend: plain autograd ops, which vmap batches (the
    fused CPU kernel's backward has no batching rule, and functorch's loop over it is ~10x slower)."""
    parameters = [p for module in modules for p in module.parameters()]
    trainable = [p.requires_grad for p in parameters]
    try:
        for p in parameters:
            p.requires_grad_(False)
        with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
            yield
    finally:
        for p, flag in zip(parameters, trainable, strict=True):
            p.requires_grad_(flag)


def singular_values(jacobians: torch.Tensor) -> torch.Tensor:
    """Singular values [..., min(m, n)] (descending) of Jacobians [..., m, n], in float64; a wide or tall
    one through the eigenvalues of its small Gram matrix (attention's is 128 × 10240 on mini)."""
    J = jacobians.double()
    m, n = J.shape[-2:]
    if max(m, n) < 2 * min(m, n):
        return torch.linalg.svdvals(J)
    gram = J @ J.transpose(-1, -2) if m < n else J.transpose(-1, -2) @ J
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(-1)


def _sublayer_paf(layer: nn.Module, index: int, name: str, number: int, captured: dict,
                  positions: list[torch.Tensor], options: PAFOptions, first_index: int) -> SubLayerPAF:
    """One sub-layer's PAF over the sampled tokens (each sub-layer draws its own seeded directions)."""
    module = dict(layer.named_modules())[name]
    if (index, name) not in captured:
        raise ValueError(f"decoder layer {first_index + index}'s {name} never ran during the forward pass")
    hidden, kwargs = _input_of(*captured[(index, name)])
    draws = torch.Generator().manual_seed(options.seed * 1_000_003 + number + 1)
    constant = is_affine(module) and name.rsplit(".", 1)[-1] != ATTENTION
    with torch.enable_grad():
        if name.rsplit(".", 1)[-1] == ATTENTION:
            jac = torch.cat([attention_jacobians(module, hidden, kwargs, b, p) for b, p in enumerate(positions)])
        else:
            tokens = torch.cat([hidden[b, p] for b, p in enumerate(positions)])
            # An affine map's Jacobian is constant: one token's stands for every token's.
            jac = token_jacobians(module, tokens[:1] if constant else tokens)
    jac = jac.detach()
    count = sum(p.numel() for p in positions)
    stats = spectrum_paf(singular_values(jac), jac.shape[1], options, draws)
    if constant:
        stats = {key: value.expand(count) for key, value in stats.items()}
    return _summary(first_index + index, name, (jac.shape[1], jac.shape[2]), stats, options.directions)


def front_paf(
    model: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cut: int,
    options: PAFOptions = PAFOptions(),
    *,
    sublayers: Sequence[str] = SUBLAYERS,
    token_mask: torch.Tensor | None = None,
    progress: bool = False,
) -> list[SubLayerPAF]:
    """PAF of the sub-layers of a LLaVA model's decoder layers [0, cut), on real decoder inputs
    (vlm.segments.merge_multimodal_inputs' hidden states, 2D mask and positions). Tokens are drawn
    among the non-padded ones, and of those only where `token_mask` [B, T] is true when given
    (e.g. the text tokens: ~visual_token_mask)."""
    layers = _front_layers(model, cut)
    return decoder_paf(
        layers[:cut],
        lambda: run_decoder_layers(model, hidden_states, attention_mask, position_ids, 0, cut),
        _candidates(attention_mask, token_mask),
        options,
        sublayers=sublayers,
        progress=progress,
    )


def whole_front_paf(
    model: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cut: int,
    options: PAFOptions = PAFOptions(),
    *,
    token_mask: torch.Tensor | None = None,
) -> SubLayerPAF:
    """PAF of the whole front F_C = decoder layers [0, cut), residual connections included: the
    Jacobian of one output row at the cut with respect to every input row of its sample (D × T·D),
    at tokens drawn as in front_paf. What an attacker at the cut inverts in one piece."""
    layers = _front_layers(model, cut)
    mask = attention_mask.bool()
    positions = sample_tokens(_candidates(attention_mask, token_mask), options.tokens_per_sample,
                              torch.Generator().manual_seed(options.seed))
    jacobians = []
    with jacobian_mode(layers[:cut]):
        for b, chosen in enumerate(positions):
            # The sample alone, without its padding (which no real row attends to).
            keep = mask[b].nonzero().flatten()
            x = hidden_states[b, keep].detach()
            ones = torch.ones(1, keep.numel(), dtype=attention_mask.dtype, device=attention_mask.device)
            where = torch.searchsorted(keep, chosen)

            def rows(x: torch.Tensor, b: int = b, where: torch.Tensor = where) -> torch.Tensor:
                out = run_decoder_layers(model, x.unsqueeze(0), ones, position_ids[b : b + 1, keep], 0, cut)
                return out[0, where]

            jacobians.append(torch.func.jacrev(rows)(x).reshape(where.numel(), x.shape[-1], -1).detach())
    draws = torch.Generator().manual_seed(options.seed * 1_000_003)
    stats = spectrum_paf(torch.cat([singular_values(j) for j in jacobians]), x.shape[-1], options, draws)
    widest = max(j.shape[-1] for j in jacobians)
    return _summary(cut - 1, f"front[0,{cut})", (x.shape[-1], widest), stats, options.directions)


def _front_layers(model: nn.Module, cut: int) -> nn.ModuleList:
    layers = llava_parts(model).language_model.layers
    if not 1 <= cut <= len(layers):
        raise ValueError(f"cut={cut}: the decoder has {len(layers)} layers, so a cut is in [1, {len(layers)}]")
    return layers


def _candidates(attention_mask: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    valid = attention_mask.bool()
    return valid if token_mask is None else valid & token_mask.bool()
