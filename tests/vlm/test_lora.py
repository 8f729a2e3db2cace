import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from vlm.cuts import split_layers
from vlm.loading import build_model_on_meta, build_random_model
from vlm.lora import (
    add_adapter,
    apply_lora,
    decoder_layer_index,
    load_owner_state,
    load_owner_state_dict,
    lora_parameters,
    owner_lora_parameters,
    owner_state_dict,
    save_owner_state,
)
from vlm.profiles import TINY, get_profile
from vlm.segments import merge_multimodal_inputs, project_visual_features, run_decoder_layers, vision_features

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPLITS = [pytest.param((), id="whole"), pytest.param((TINY.sl_cut,), id="sl"), pytest.param(TINY.usl_cuts, id="usl")]
OWNER_SEGMENTS = [
    pytest.param(segment, id=segment.owner)
    for cuts in ((TINY.sl_cut,), TINY.usl_cuts)
    for segment in split_layers(TINY.num_layers, cuts)
]


def randomise_lora(model: PeftModel, seed: int) -> None:
    """peft starts lora_B at zero (LoRA is a no-op); random values make every test meaningful."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in lora_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))


@pytest.fixture
def lora_model() -> PeftModel:
    model = apply_lora(build_random_model(TINY, seed=0), rank=TINY.lora_rank)
    randomise_lora(model, seed=1)
    return model


def test_lora_wraps_exactly_the_seven_decoder_projections_of_every_layer(lora_model):
    wrapped = {name for name, module in lora_model.named_modules() if isinstance(module, LoraLayer)}
    expected = {
        f"base_model.model.model.language_model.layers.{layer}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
        for layer in range(TINY.num_layers)
        for p in PROJECTIONS
    }
    assert wrapped == expected
    assert not any("vision_tower" in name or "multi_modal_projector" in name for name in lora_parameters(lora_model))


def test_only_lora_parameters_train(lora_model):
    trainable = {name for name, p in lora_model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(lora_model))
    assert len(trainable) == TINY.num_layers * len(PROJECTIONS) * 2


@pytest.mark.parametrize("cuts", SPLITS)
def test_owners_partition_the_lora_parameters(lora_model, cuts):
    owned = [set(owner_lora_parameters(lora_model, s)) for s in split_layers(TINY.num_layers, cuts)]
    assert sum(len(names) for names in owned) == len(set().union(*owned))  # no overlap
    assert set().union(*owned) == set(lora_parameters(lora_model))  # nothing missing
    state_keys = [set(owner_state_dict(lora_model, s)) for s in split_layers(TINY.num_layers, cuts)]
    assert sum(len(keys) for keys in state_keys) == len(set().union(*state_keys)) == len(lora_parameters(lora_model))


@pytest.mark.parametrize("segment", OWNER_SEGMENTS)
def test_owner_file_restores_only_that_owner(lora_model, segment, tmp_path):
    path = tmp_path / f"{segment.owner}.safetensors"
    saved = {name: p.detach().clone() for name, p in lora_parameters(lora_model).items()}
    save_owner_state(lora_model, segment, path)
    randomise_lora(lora_model, seed=2)
    perturbed = {name: p.detach().clone() for name, p in lora_parameters(lora_model).items()}
    load_owner_state(lora_model, segment, path)
    for name, parameter in lora_parameters(lora_model).items():
        expected = saved[name] if decoder_layer_index(name) in segment else perturbed[name]
        assert torch.equal(parameter, expected), name
    assert any(not torch.equal(saved[n], perturbed[n]) for n in owner_lora_parameters(lora_model, segment))


def test_loading_refuses_another_owners_state_or_file(lora_model, tmp_path):
    head, body, _ = split_layers(TINY.num_layers, TINY.usl_cuts)
    with pytest.raises(ValueError, match=r"owner 'body' \(layers \[1, 3\)\).*foreign keys"):
        load_owner_state_dict(lora_model, body, owner_state_dict(lora_model, head))
    partial = dict(list(owner_state_dict(lora_model, body).items())[1:])
    with pytest.raises(ValueError, match="1 missing"):
        load_owner_state_dict(lora_model, body, partial)
    save_owner_state(lora_model, head, tmp_path / "head.safetensors")
    with pytest.raises(ValueError, match="holds adapters of .*'head'.*not of .*'body'"):
        load_owner_state(lora_model, body, tmp_path / "head.safetensors")


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_segments_run_through_the_peft_wrapper_and_use_the_adapters(attn_implementation, make_prompts):
    model = apply_lora(build_random_model(TINY, seed=0, attn_implementation=attn_implementation), rank=TINY.lora_rank)
    randomise_lora(model, seed=1)
    pixel_values = torch.randn(2, 3, TINY.image_size, TINY.image_size, generator=torch.Generator().manual_seed(0))
    prompts = make_prompts([1, 3], [2, 0])
    visual = project_visual_features(model, vision_features(model, pixel_values))
    inputs = merge_multimodal_inputs(model, prompts, visual)
    run = lambda: run_decoder_layers(  # noqa: E731
        model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, TINY.num_layers, apply_head=True
    )
    logits = run()
    logits[:, -1].sum().backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == set(lora_parameters(model))
    with torch.no_grad(), model.disable_adapter():
        without_adapters = run()
    assert (logits - without_adapters).abs().max() > 1e-3


def test_llava_7b_lora_size_on_meta():
    profile = get_profile("llava-1.5-7b")
    model = apply_lora(build_model_on_meta(profile), rank=profile.lora_rank)
    assert round(sum(p.numel() for p in lora_parameters(model).values()) / 1e6, 2) == 79.95
    owner_sizes = lambda cuts: {  # noqa: E731
        s.owner: sum(p.numel() for p in owner_lora_parameters(model, s).values()) for s in split_layers(32, cuts)
    }
    first_layer, second_layer, _ = owner_sizes((1, 2)).values()
    assert round(first_layer / 1e6, 2) == 2.50 and first_layer == second_layer
    assert owner_sizes((8, 24)) == {"head": 8 * first_layer, "body": 16 * first_layer, "tail": 8 * first_layer}


@pytest.mark.parametrize("rank, dropout, message", [(0, 0.0, "rank=0"), (4, 1.0, "dropout=1.0")])
def test_apply_lora_rejects_bad_settings(rank, dropout, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(build_random_model(TINY), rank=rank, dropout=dropout)


def test_a_second_adapter_set_on_one_base_starts_where_it_is_told_and_trains_alone(lora_model):
    randomise_lora(lora_model, seed=1)
    segments = split_layers(TINY.num_layers, TINY.usl_cuts)
    start = {key: value for segment in segments for key, value in owner_state_dict(lora_model, segment).items()}
    add_adapter(lora_model, "client_a", start)
    lora_model.set_adapter("client_a")
    for segment in segments:
        for key, value in owner_state_dict(lora_model, segment, "client_a").items():
            assert torch.equal(value, start[key])
    assert set(lora_parameters(lora_model, "client_a")).isdisjoint(lora_parameters(lora_model))
    with torch.no_grad():
        for parameter in lora_parameters(lora_model, "client_a").values():
            parameter.add_(1.0)
    for segment in segments:  # the default set is untouched
        for key, value in owner_state_dict(lora_model, segment).items():
            assert torch.equal(value, start[key])
    assert all(p.requires_grad for p in lora_parameters(lora_model, "client_a").values())
    assert not any(p.requires_grad for p in lora_parameters(lora_model).values())
