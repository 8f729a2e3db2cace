"""PAF (privacy.paf): closed forms on matrices whose answer is known, the estimator against the
definition read literally, Jacobians against their formulas, and the qpriv-privacy command on tiny."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from privacy.paf import (
    REDUCES,
    SUBLAYERS,
    THETAS,
    PAFOptions,
    attention_jacobians,
    capture_inputs,
    direction_paf,
    front_paf,
    jacobian_paf,
    singular_values,
    token_jacobians,
    unit_sphere_abs_mean,
    whole_front_paf,
    worst_direction,
)

READINGS = [(theta, reduce) for theta in THETAS for reduce in REDUCES]
# Token ids for the random tiny model (any below 64 do; the prompts below use the placeholder once).
RANDOM_VOCAB_SIZE, RANDOM_IMAGE_ID, RANDOM_PAD_ID = 64, 62, 63
ROOT = Path(__file__).parents[2]


def orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def test_unit_sphere_constant_matches_its_known_values():
    assert unit_sphere_abs_mean(1) == pytest.approx(1.0)
    assert unit_sphere_abs_mean(2) == pytest.approx(2 / math.pi)
    assert unit_sphere_abs_mean(3) == pytest.approx(0.5)


@pytest.mark.parametrize("n", [8, 32])
def test_identity_and_orthogonal_maps_have_the_closed_form(n):
    options = PAFOptions(directions=4000)
    expected = n * unit_sphere_abs_mean(n) / math.sqrt(2)  # every σ_i = 1, ‖J‖₂ = 1
    for J in (torch.eye(n, dtype=torch.float64), orthogonal(n)):
        result = jacobian_paf(J, options, torch.Generator().manual_seed(1))
        assert result["paf"] == pytest.approx(expected, abs=4 * result["mc_std"] / math.sqrt(4000))
        assert result["max_paf"] == pytest.approx(math.sqrt(n / 2))
        assert result["norm"] == pytest.approx(1.0)


def test_scaling_a_map_raises_its_paf_as_a_over_sqrt_a2_plus_1():
    n, options = 16, PAFOptions(directions=4000)
    for a in (0.1, 1.0, 10.0):
        result = jacobian_paf(a * orthogonal(n), options, torch.Generator().manual_seed(2))
        expected = n * unit_sphere_abs_mean(n) * a / math.sqrt(a * a + 1)
        assert result["paf"] == pytest.approx(expected, rel=0.01)


def test_a_direction_the_layer_kills_lowers_the_default_paf_and_raises_the_output_readings():
    n = 16
    identity = torch.eye(n, dtype=torch.float64)
    tiny = identity.clone()
    tiny[-1, -1] = 1e-8
    pull = PAFOptions(directions=4000)
    p_id = jacobian_paf(identity, pull, torch.Generator().manual_seed(3))["paf"]
    p_tiny = jacobian_paf(tiny, pull, torch.Generator().manual_seed(3))["paf"]
    # Pull-back reading: the killed direction drops out, the rest is the identity of size n - 1.
    assert p_tiny == pytest.approx((n - 1) * unit_sphere_abs_mean(n - 1) / math.sqrt(2), rel=0.01)
    assert p_tiny < p_id
    # Output reading: its weight is ‖J‖₂/sqrt(0 + 1) = 1 instead of 1/√2 (closed form: κ_n Σ_i w_i).
    out = PAFOptions(directions=4000, theta="output")
    o_id = jacobian_paf(identity, out, torch.Generator().manual_seed(3))["paf"]
    o_tiny = jacobian_paf(tiny, out, torch.Generator().manual_seed(3))["paf"]
    kappa = unit_sphere_abs_mean(n)
    assert o_id == pytest.approx(kappa * n / math.sqrt(2), rel=0.01)
    assert o_tiny == pytest.approx(kappa * ((n - 1) / math.sqrt(2) + 1), rel=0.01)
    assert o_tiny > o_id


@pytest.mark.parametrize("theta,reduce", READINGS)
@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_max_paf_is_the_worst_direction_and_bounds_every_other(theta, reduce, shape):
    options = PAFOptions(directions=1, theta=theta, reduce=reduce)
    J = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    deltas = torch.randn(3000, shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    sampled = direction_paf(J, deltas, options)
    stats = jacobian_paf(J, PAFOptions(directions=500, theta=theta, reduce=reduce), torch.Generator().manual_seed(6))
    assert float(sampled.max()) <= stats["max_paf"] + 1e-9
    assert stats["max_paf"] >= stats["paf"]
    assert float(direction_paf(J, worst_direction(J, options), options)) == pytest.approx(stats["max_paf"], rel=1e-9)


@pytest.mark.parametrize("theta,reduce", READINGS)
def test_the_spectrum_shortcut_estimates_the_definition_read_literally(theta, reduce):
    """spectrum_paf samples coordinates in the singular basis; direction_paf evaluates the angles
    between δJ and J's right singular vectors (or δ and the left ones) from the SVD itself."""
    J = torch.randn(10, 24, generator=torch.Generator().manual_seed(7), dtype=torch.float64) @ torch.diag(
        torch.linspace(0.05, 3, 24, dtype=torch.float64))
    deltas = torch.randn(4000, 10, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    literal = direction_paf(J, deltas, PAFOptions(theta=theta, reduce=reduce))
    shortcut = jacobian_paf(J, PAFOptions(directions=4000, theta=theta, reduce=reduce), torch.Generator().manual_seed(9))
    stderr = math.hypot(float(literal.std()), shortcut["mc_std"]) / math.sqrt(4000)
    assert shortcut["paf"] == pytest.approx(float(literal.mean()), abs=4 * stderr)


def test_the_monte_carlo_estimate_is_seeded_and_stable():
    J = torch.randn(64, 64, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    runs = [jacobian_paf(J, PAFOptions(), torch.Generator().manual_seed(seed)) for seed in (0, 0, 1, 2, 3)]
    assert runs[0] == runs[1]
    estimates = [r["paf"] for r in runs]
    stderr = runs[0]["mc_std"] / math.sqrt(100)
    assert max(estimates) - min(estimates) < 8 * stderr
    assert stderr / runs[0]["paf"] < 0.02


def test_singular_values_of_wide_and_tall_matrices_through_the_gram_matrix():
    for shape in ((6, 40), (40, 6), (9, 9)):
        J = torch.randn(*shape, generator=torch.Generator().manual_seed(11))
        assert torch.allclose(singular_values(J), torch.linalg.svdvals(J.double()), rtol=1e-6, atol=1e-9)


# -- Jacobians on a model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """The tiny LLaVA (random weights, LoRA as every party builds it) and decoder inputs for 2 rows
    of different lengths (left padding), through vlm alone."""
    from vlm.loading import build_random_model
    from vlm.lora import apply_lora
    from vlm.profiles import TINY
    from vlm.segments import merge_multimodal_inputs

    model = build_random_model(TINY, seed=0, vocab_size=RANDOM_VOCAB_SIZE, image_token_id=RANDOM_IMAGE_ID,
                               pad_token_id=RANDOM_PAD_ID)
    torch.manual_seed(0)
    model = apply_lora(model, rank=TINY.lora_rank).eval()
    grid = (TINY.image_size // TINY.patch_size) ** 2
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.tensor([1, 2, RANDOM_IMAGE_ID, 5, 6, 7]), torch.tensor([1, 2, RANDOM_IMAGE_ID, 9])]
    visual = [torch.randn(grid, TINY.text["hidden_size"], generator=generator) for _ in prompts]
    return model, merge_multimodal_inputs(model, prompts, visual, [torch.tensor([3]), torch.tensor([4, 8])])


def layers_of(model):
    from vlm.segments import llava_parts

    return llava_parts(model).language_model.layers


def test_rmsnorm_jacobian_is_its_formula(tiny):
    model, _ = tiny
    norm = layers_of(model)[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, norm.weight.numel()))
    x = torch.randn(3, norm.weight.numel(), generator=torch.Generator().manual_seed(12))
    r = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    n = x.shape[-1]
    eye = torch.eye(n)
    expected = norm.weight[:, None] / r[:, :, None] * (eye - x[:, :, None] * x[:, None, :] / (n * r[:, :, None] ** 2))
    assert torch.allclose(token_jacobians(norm, x), expected, atol=1e-5)


def test_attention_jacobian_matches_autograd_on_the_sample_alone(tiny):
    from vlm.segments import run_decoder_layers

    model, inputs = tiny
    layer = layers_of(model)[0]
    captured = capture_inputs([layer], ["self_attn"], lambda: run_decoder_layers(
        model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, 1))
    kwargs = dict(captured[(0, "self_attn")][1])
    hidden = kwargs.pop("hidden_states")
    positions = torch.tensor([hidden.shape[1] - 1, hidden.shape[1] - 3])
    got = attention_jacobians(layer.self_attn, hidden, kwargs, 1, positions)
    mask = kwargs["attention_mask"]
    cos, sin = kwargs["position_embeddings"]

    def rows(x):
        out = layer.self_attn(hidden_states=x[None], attention_mask=None if mask is None else mask[1:2],
                              position_embeddings=(cos[1:2], sin[1:2]))[0]
        return out[0, positions]

    expected = torch.autograd.functional.jacobian(rows, hidden[1]).reshape(2, hidden.shape[-1], -1)
    assert torch.allclose(got, expected, atol=1e-5)
    # The padded slots of the shorter sample (left) are never attended to.
    padded = int((inputs.attention_mask[1] == 0).sum())
    assert padded > 0 and got.reshape(2, hidden.shape[-1], hidden.shape[1], -1)[:, :, :padded].abs().max() == 0


def test_front_paf_reports_every_sub_layer_and_leaves_the_model_as_it_was(tiny):
    model, inputs = tiny
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    results = front_paf(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 2,
                        PAFOptions(directions=20, tokens_per_sample=3))
    assert [(r.layer, r.name) for r in results] == [(i, name) for i in range(2) for name in SUBLAYERS]
    assert flags == {name: p.requires_grad for name, p in model.named_parameters()}
    by_name = {r.label: r for r in results}
    assert all(r.tokens == 6 and r.max_paf_mean >= r.paf_mean > 0 for r in results)
    # A projection's Jacobian is its weight: the same for every token.
    assert by_name["0.self_attn.q_proj"].paf_std == 0
    assert by_name["0.input_layernorm"].paf_std > 0
    assert by_name["0.self_attn"].shape == (inputs.hidden_states.shape[-1],
                                            inputs.hidden_states.shape[1] * inputs.hidden_states.shape[-1])
    with pytest.raises(ValueError, match=r"a cut is in \[1, 4\]"):
        front_paf(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 5)


def test_whole_front_of_one_layer_is_the_identity_plus_its_blocks(tiny):
    """With the attention's output projection and the MLP's down projection zeroed, layer 0 is the
    identity: the whole front's PAF at cut 1 is then the identity's over the sample's T·D inputs."""
    import copy

    model, inputs = tiny
    model = copy.deepcopy(model)
    layer = layers_of(model)[0]
    with torch.no_grad():
        layer.self_attn.o_proj.base_layer.weight.zero_()
        layer.mlp.down_proj.base_layer.weight.zero_()
    text = ~inputs.visual_token_mask
    result = whole_front_paf(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 1,
                             PAFOptions(directions=2000, tokens_per_sample=2), token_mask=text)
    d = inputs.hidden_states.shape[-1]
    # One row of the identity on T·D inputs: D unit singular values.
    assert result.norm_mean == pytest.approx(1.0, abs=1e-5)
    assert result.paf_mean == pytest.approx(d * unit_sphere_abs_mean(d) / math.sqrt(2), rel=0.02)
    assert result.max_paf_mean == pytest.approx(math.sqrt(d / 2), rel=1e-5)


# -- the command -----------------------------------------------------------------------------------
def test_the_command_on_tiny_writes_one_row_per_sub_layer(tmp_path, capsys):
    from sims.privacy_cli import main

    out = tmp_path / "report"
    assert main(["paf", "--profile", "tiny", "--stage", "random", "--cut", "2", "--samples", "2",
                 "--directions", "10", "--tokens", "2", "--no-progress", "--out", str(out)]) == 0
    report = json.loads((out / "paf.json").read_text())
    assert [(r["layer"], r["name"]) for r in report["layers"]] == [(i, n) for i in range(2) for n in SUBLAYERS]
    assert report["cut"] == 2 and report["samples"] == 2 and report["options"]["directions"] == 10
    rows = [line for line in (out / "paf.md").read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 2 * len(SUBLAYERS)
    assert (out / "paf.png").stat().st_size > 0


@pytest.mark.parametrize("arguments,message", [
    (["--cut", "5"], "--cut 5: profile 'tiny' has 4 decoder layers, so a cut is in [1, 4]"),
    (["--cut", "0"], "--cut 0"),
    (["--samples", "0"], "--samples 0: must be at least 1"),
    (["--directions", "0"], "--directions 0: must be at least 1"),
])
def test_the_command_refuses_bad_arguments_saying_which(arguments, message, capsys, tmp_path):
    from sims.privacy_cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["paf", "--profile", "tiny", "--out", str(tmp_path), *arguments])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_committed_benchmark_markdown_is_what_report_renders_from_its_json(tmp_path):
    results = ROOT / "results" / "paf_actinv.json"
    if not results.exists():
        pytest.skip("results/paf_actinv.json not measured yet")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import paf_actinv

    rendered = paf_actinv.render_report(json.loads(results.read_text()), tmp_path)
    assert rendered.read_bytes() == (ROOT / "results" / "paf_actinv.md").read_bytes()
