"""Every registered defense: what it sends, how gradients pass it, its seeding and its options."""

import pytest
import torch

from config import ConfigError, load_config
from privacy import (
    ACTIVATION,
    EDGE,
    GRADIENT,
    LOSS,
    DefenseChain,
    DefenseSeed,
    Payload,
    defense_class,
    defense_names,
    options_from,
)
from privacy.nopeek import distance_correlation
from privacy.pripert import PriPert
from training.model import load_party_model
from vlm.segments import run_decoder_layers
from wire import pack_rows, unpack_rows

SEED = DefenseSeed(seed=0, client=1, round=2, step=3)
# The defenses at a cut (a Payload in, the defended rows out); EDGE ones: tests/privacy/test_edge.py.
CUT_DEFENSES = [n for n in defense_names() if defense_class(n).stage != EDGE]


def build(name: str, **options):
    cls = defense_class(name)
    return cls(options_from(cls, options))


@pytest.fixture(scope="module")
def tiny_front():
    """The tiny profile's USL head as a function of packed input rows: 2 samples of 6 tokens."""
    config = load_config({"output.name": "x", "model.profile": "tiny", "model.stage": "random"})
    model = load_party_model(config).model
    torch.manual_seed(0)
    embedding = model.get_base_model().get_input_embeddings().weight.detach()
    inputs, lengths = pack_rows(embedding[torch.randint(embedding.shape[0], (2, 6))], torch.ones(2, 6, dtype=torch.long))

    def front(rows: torch.Tensor) -> torch.Tensor:
        hidden, mask, positions = unpack_rows(rows, lengths)
        return pack_rows(run_decoder_layers(model, hidden, mask, positions, 0, config.split.cut_a), mask)[0]

    return model, inputs, lengths, front


def payload_of(tiny_front, rows=None) -> Payload:
    _, inputs, lengths, front = tiny_front
    with torch.no_grad():
        rows = front(inputs) if rows is None else rows
    return Payload(rows, lengths, inputs=inputs, front=front)


@pytest.mark.parametrize("name", CUT_DEFENSES)
def test_every_defense_validates_its_defaults_and_says_where_it_acts(name):
    defense = build(name)
    assert defense.describe()["name"] == name and defense.stage in (ACTIVATION, GRADIENT, LOSS)
    assert defense.describe()["options"]


@pytest.mark.parametrize("name", CUT_DEFENSES)
def test_gradients_through_every_defense_are_those_of_its_fixed_mask_and_shift(name, tiny_front):
    """Backward through the defended rows passes the incoming gradient where an element is sent
    and nothing where the defense zeroed it; a LOSS defense adds a differentiable term."""
    payload = payload_of(tiny_front)
    rows = payload.rows.clone().requires_grad_()
    out = build(name).apply(Payload(rows, payload.lengths, payload.inputs, payload.front), SEED)
    incoming = torch.randn(rows.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(out.rows, rows, incoming, retain_graph=out.loss is not None)
    torch.testing.assert_close(grad, incoming * (out.rows != 0), rtol=0, atol=0)
    if defense_class(name).stage == LOSS:
        assert out.rows is rows
        (loss_grad,) = torch.autograd.grad(out.loss, rows)
        assert loss_grad.abs().sum() > 0


@pytest.mark.parametrize("name", [n for n in CUT_DEFENSES if defense_class(n).random])
def test_random_defenses_draw_only_from_their_seed(name, tiny_front):
    payload = payload_of(tiny_front)
    # NoPeek draws which rows enter its correlation: fewer than the payload holds.
    options = {"max_rows": 4} if name == "nopeek" else {}
    first, again = build(name, **options).apply(payload, SEED), build(name, **options).apply(payload, SEED)
    torch.testing.assert_close(first.rows, again.rows, rtol=0, atol=0)
    if first.loss is not None:
        torch.testing.assert_close(first.loss, again.loss, rtol=0, atol=0)
    other = build(name, **options).apply(payload, DefenseSeed(0, 1, 2, 4))
    assert not torch.equal(first.rows, other.rows) or (first.loss is not None and not torch.equal(first.loss, other.loss))


@pytest.mark.parametrize("variance", [1e-4, 1e-2, 1.0])
def test_noise_has_the_configured_variance(variance):
    rows = torch.zeros(4000, 32)
    out = build("noise", variance=variance).apply(Payload(rows, torch.tensor([1000, 3000])), SEED)
    assert out.rows.mean().abs() < 0.01 * variance**0.5 * 3
    assert abs(out.rows.var().item() / variance - 1) < 0.03


@pytest.mark.parametrize("level", ["element", "token"])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_sparsification_zeroes_exactly_the_configured_share_of_each_sample(level, ratio):
    lengths = torch.tensor([5, 7, 11])
    rows = torch.randn(int(lengths.sum()), 16, generator=torch.Generator().manual_seed(0))
    out = build("sparsify", ratio=ratio, level=level).apply(Payload(rows, lengths), SEED)
    for sample, sent in zip(torch.split(rows, lengths.tolist()), torch.split(out.rows, lengths.tolist()), strict=True):
        if level == "element":
            zeroed = sent == 0
            assert int(zeroed.sum()) == round(ratio * sample.numel())
            # The zeroed ones are the smallest in magnitude.
            assert sample.abs()[zeroed].max() <= sample.abs()[~zeroed].min()
        else:
            zeroed = (sent == 0).all(-1)
            assert int(zeroed.sum()) == round(ratio * sample.shape[0])
            assert torch.equal(sent[~zeroed], sample[~zeroed])
            if zeroed.any():
                assert sample.norm(dim=-1)[zeroed].max() <= sample.norm(dim=-1)[~zeroed].min()


def test_the_gradient_top_k_keeps_the_largest_share_of_each_sample():
    grad = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    out = build("grad_topk", ratio=0.75).apply(Payload(grad, torch.tensor([4, 8])), SEED)
    for sample, sent in zip(torch.split(grad, [4, 8]), torch.split(out.rows, [4, 8]), strict=True):
        assert int((sent != 0).sum()) == sample.numel() // 4
        assert torch.equal(sent[sent != 0], sample[sent != 0])


@pytest.fixture(scope="module")
def linear_inversion_error(tiny_front):
    """A white-box inverter that takes the sent rows at face value, linearised at the true input:
    the input error J⁻¹(ẑ − z), relative to the input's norm."""
    _, inputs, _, front = tiny_front
    with torch.no_grad():
        z = front(inputs)
    jacobian = torch.autograd.functional.jacobian(front, inputs, vectorize=True).reshape(z.numel(), inputs.numel())
    factors = torch.linalg.lu_factor(jacobian)

    def error(sent: torch.Tensor) -> float:
        solved = torch.linalg.lu_solve(*factors, (sent - z).reshape(-1, 1))
        return float(solved.norm() / inputs.norm())

    return error


@pytest.mark.parametrize("sparsity", [0.1, 0.5])
def test_pripert_l0_keeps_exactly_its_top_k_and_misleads_an_inverter_more_than_random_zeroing(
    sparsity, tiny_front, linear_inversion_error
):
    payload = payload_of(tiny_front)
    defense = build("pripert", sparsity=sparsity)
    out = defense.apply(payload, SEED)
    # Exactly round(sparsity · n) zeroed per sample, and those are the highest by its score.
    u, _, _ = defense.direction(payload, SEED)
    contribution = payload.rows * u
    for rows, sent, part in zip(payload.samples(), payload.samples(out.rows), payload.samples(contribution), strict=True):
        zeroed = sent == 0
        assert int(zeroed.sum()) == round(sparsity * rows.numel())
        score = part if part.clamp_min(0).sum() >= (-part).clamp_min(0).sum() else -part
        assert score[zeroed].min() >= score[~zeroed].max()
    random_errors = []
    for seed in range(5):
        keep = torch.ones(payload.rows.numel())
        keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(seed))[: round(sparsity * keep.numel())]] = 0
        random_errors.append(linear_inversion_error(payload.rows * keep.view_as(payload.rows)))
    assert linear_inversion_error(out.rows) > max(random_errors)


def test_pripert_l2_moves_the_inversion_further_than_a_random_direction_of_its_norm(tiny_front, linear_inversion_error):
    payload = payload_of(tiny_front)
    out = build("pripert", variant="l2", budget=0.1).apply(payload, SEED)
    shift = out.rows - payload.rows
    for rows, part in zip(payload.samples(), payload.samples(shift), strict=True):
        torch.testing.assert_close(part.norm(), 0.1 * rows.norm(), rtol=1e-4, atol=0)
    random = torch.randn(shift.shape, generator=torch.Generator().manual_seed(0))
    random = random / random.norm() * shift.norm()
    assert linear_inversion_error(out.rows) > 1.2 * linear_inversion_error(payload.rows + random)


def test_nopeek_lowers_the_distance_correlation_of_what_the_front_sends(tiny_front):
    model, inputs, lengths, front = tiny_front
    parameters = [p for name, p in model.named_parameters() if "lora_" in name and ".layers.0." in name]
    saved = [p.detach().clone() for p in parameters]
    optimizer = torch.optim.Adam(parameters, lr=1e-2)
    defense = build("nopeek", weight=1.0)
    try:
        with torch.no_grad():
            before = float(distance_correlation(inputs, front(inputs)))
        for step in range(10):
            out = defense.apply(Payload(front(inputs), lengths, inputs=inputs, front=front), DefenseSeed(0, 0, 1, step))
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            optimizer.step()
        with torch.no_grad():
            after = float(distance_correlation(inputs, front(inputs)))
    finally:
        with torch.no_grad():
            for parameter, value in zip(parameters, saved, strict=True):
                parameter.copy_(value)
    assert after < before - 0.05


def test_a_chain_of_none_sends_the_very_tensor_and_a_chain_applies_in_order():
    rows, lengths = torch.randn(10, 8), torch.tensor([4, 6])
    assert DefenseChain().apply((ACTIVATION, LOSS), Payload(rows, lengths), SEED).rows is rows
    names = ["noise", "sparsify"]
    options = {"noise": options_from(defense_class("noise"), {"variance": 0.1}),
               "sparsify": options_from(defense_class("sparsify"), {"ratio": 0.5})}
    noise_then_zero = DefenseChain.build(names, options).apply((ACTIVATION,), Payload(rows, lengths), SEED)
    zero_then_noise = DefenseChain.build(names[::-1], options).apply((ACTIVATION,), Payload(rows, lengths), SEED)
    assert int((noise_then_zero.rows == 0).sum()) == 40 and int((zero_then_noise.rows == 0).sum()) == 0
    assert set(noise_then_zero.metrics) == {"noise.snr_db", "sparsify.zeroed_share"}
    # A chain acts only at the stages asked for.
    assert DefenseChain.build(names, options).apply((GRADIENT,), Payload(rows, lengths), SEED).rows is rows


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"privacy.defenses": "noise,sparsifyy"}, "privacy.defenses"),
        ({"privacy.defenses": "noise,noise"}, "privacy.defenses"),
        ({"privacy.defenses": "noise", "privacy.noise.variance": 0.0}, "privacy.noise.variance"),
        ({"privacy.defenses": "sparsify", "privacy.sparsify.level": "row"}, "privacy.sparsify.level"),
        ({"privacy.defenses": "pripert", "privacy.pripert.steps": 4}, "privacy.pripert.steps"),
        ({"paradigm": "sl", "privacy.defenses": "grad_noise"}, "privacy.defenses"),
        ({"paradigm": "fl", "privacy.defenses": "noise"}, "privacy.defenses"),
    ],
)
def test_the_run_config_refuses_a_bad_defense_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as caught:
        load_config({"output.name": "x", **overrides})
    assert caught.value.key == key


def test_an_inactive_defense_s_options_are_checked_too():
    with pytest.raises(ConfigError) as caught:
        load_config({"output.name": "x", "privacy.noise.variance": 0.0})
    assert caught.value.key == "privacy.noise.variance"
