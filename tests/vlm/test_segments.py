"""The backbone's first test: the split model equals the monolithic one, forward and backward."""

import dataclasses

import pytest
import torch

from vlm.cuts import split_layers
from vlm.loading import build_random_model
from vlm.profiles import TINY
from vlm.segments import (
    IGNORE_INDEX,
    DecoderInputs,
    decoder_attention,
    greedy_generate,
    llava_parts,
    merge_multimodal_inputs,
    next_token_loss,
    project_visual_features,
    run_decoder_layers,
    run_segment,
    vision_features,
    vision_hidden_states,
)

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
CUTS = [pytest.param((), id="whole"), pytest.param((TINY.sl_cut,), id="sl"), pytest.param(TINY.usl_cuts, id="usl")]
PADDING_SIDES = ("left", "right")


def prune_randomly(features: torch.Tensor, keep_counts: list[int], seed: int = 4) -> list[torch.Tensor]:
    """Per-sample random subsets of patches, kept in grid order, as pruning will hand them on."""
    generator = torch.Generator().manual_seed(seed)
    kept = []
    for sample, keep in enumerate(keep_counts):
        indices = torch.randperm(features.shape[1], generator=generator)[:keep].sort().values
        kept.append(features[sample, indices])
    return kept


def run_split_forward(
    model: torch.nn.Module, inputs: DecoderInputs, cuts: tuple[int, ...]
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run the segments as separate parties would: each receives a detached copy of the
    previous party's output. Returns the logits and each segment's (input, output)."""
    hidden_states = inputs.hidden_states
    relay = []
    for index, segment in enumerate(split_layers(llava_parts(model).num_layers, cuts)):
        received = hidden_states if index == 0 else hidden_states.detach().requires_grad_()
        hidden_states = run_segment(model, segment, received, inputs.attention_mask, inputs.position_ids)
        relay.append((received, hidden_states))
    return hidden_states, relay


def backward_split(loss: torch.Tensor, relay: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Backward from the last party to the first, passing only the cut gradients across."""
    loss.backward()
    for index in range(len(relay) - 2, -1, -1):
        _, output = relay[index]
        received_by_next, _ = relay[index + 1]
        output.backward(received_by_next.grad)


def monolithic_logits(model: torch.nn.Module, inputs: DecoderInputs) -> torch.Tensor:
    parts = llava_parts(model)
    hidden_states = parts.language_model(
        inputs_embeds=inputs.hidden_states,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
    ).last_hidden_state
    return parts.lm_head(hidden_states)


def expand_for_reference(prompts: list[torch.Tensor], num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaVA's own input format: N image tokens in place of each placeholder, left-padded."""
    expanded = []
    for prompt in prompts:
        pieces = [torch.full((num_patches,), TINY.image_token_id) if token == TINY.image_token_id else token[None]
                  for token in prompt]
        expanded.append(torch.cat(pieces))
    length = max(len(ids) for ids in expanded)
    input_ids = torch.full((len(expanded), length), TINY.text["pad_token_id"])
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(expanded):
        input_ids[row, length - len(ids) :] = ids
        attention_mask[row, length - len(ids) :] = 1
    return input_ids, attention_mask


def test_vision_features_match_llava_and_skip_unused_layers(tiny_model, pixel_values):
    calls = []
    tower = llava_parts(tiny_model).vision_tower
    hooks = [
        tower.encoder.layers[-1].register_forward_hook(lambda *_: calls.append("last layer")),
        tower.post_layernorm.register_forward_hook(lambda *_: calls.append("post_layernorm")),
    ]
    features = vision_features(tiny_model, pixel_values)
    for hook in hooks:
        hook.remove()
    assert calls == []
    assert features.shape == (3, TINY.num_patches, TINY.vision_hidden_size)
    reference = torch.stack(tiny_model.model.get_image_features(pixel_values).pooler_output)
    torch.testing.assert_close(project_visual_features(tiny_model, features), reference, **TOLERANCE)


def test_vision_hidden_states_are_huggingfaces_patch_rows_up_to_the_feature_layer(tiny_model, pixel_values):
    states = vision_hidden_states(tiny_model, pixel_values)
    reference = llava_parts(tiny_model).vision_tower(pixel_values, output_hidden_states=True).hidden_states
    layer = TINY.vision_feature_layer % len(reference)
    assert len(states) == layer + 1
    for mine, theirs in zip(states, reference, strict=False):
        torch.testing.assert_close(mine, theirs[:, 1:], **TOLERANCE)
    torch.testing.assert_close(states[-1], vision_features(tiny_model, pixel_values))


@pytest.mark.parametrize("cuts", CUTS)
def test_segments_reproduce_llava_forward_without_pruning(tiny_model, pixel_values, make_prompts, cuts):
    prompts = make_prompts([2, 5, 0], [3, 1, 4])
    visual = project_visual_features(tiny_model, vision_features(tiny_model, pixel_values))
    inputs = merge_multimodal_inputs(tiny_model, prompts, visual)
    with torch.no_grad():
        logits, _ = run_split_forward(tiny_model, inputs, cuts)
        input_ids, attention_mask = expand_for_reference(prompts, TINY.num_patches)
        reference = tiny_model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        ).logits
    assert torch.equal(inputs.attention_mask, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], reference[real], **TOLERANCE)


def test_multi_image_prompts_reproduce_llava_forward(tiny_model, pixel_values):
    """In-context demonstrations: a prompt with one placeholder per image, each replaced by its own
    image's tokens in order, as LLaVA's forward does with several images in one prompt."""
    image = TINY.image_token_id
    prompts = [torch.tensor([5, image, 6, 7, image, 8]), torch.tensor([9, image, 10, image, 11, image, 12])]
    with torch.no_grad():
        visual = project_visual_features(tiny_model, vision_features(tiny_model, pixel_values))
        inputs = merge_multimodal_inputs(tiny_model, prompts, [(visual[0], visual[1]), tuple(visual)])
        logits = run_decoder_layers(tiny_model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids,
                                    0, TINY.num_layers, apply_head=True)
        input_ids, attention_mask = expand_for_reference(prompts, TINY.num_patches)
        reference = tiny_model(
            input_ids=input_ids,
            pixel_values=torch.cat([pixel_values[:2], pixel_values]),
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        ).logits
    assert inputs.visual_token_mask.sum(-1).tolist() == [2 * TINY.num_patches, 3 * TINY.num_patches]
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], reference[real], **TOLERANCE)
    with pytest.raises(ValueError, match="2 times; it must appear exactly once per image \\(3\\)"):
        merge_multimodal_inputs(tiny_model, prompts[:1], [tuple(visual)])


@pytest.mark.parametrize("padding_side", PADDING_SIDES)
@pytest.mark.parametrize("cuts", CUTS[1:])
def test_split_forward_and_backward_equal_monolithic_with_pruning(
    tiny_model, pixel_values, make_prompts, make_answers, padding_side, cuts
):
    prompts = make_prompts([1, 4, 0], [2, 0, 3])
    answers = make_answers([2, 1, 3])
    keep_counts = [5, TINY.k_min, TINY.num_patches]

    def build_inputs() -> DecoderInputs:
        features = vision_features(tiny_model, pixel_values)
        kept = prune_randomly(features, keep_counts)
        visual = [project_visual_features(tiny_model, tokens) for tokens in kept]
        return merge_multimodal_inputs(tiny_model, prompts, visual, answers, padding_side=padding_side)

    tiny_model.zero_grad()
    split_inputs = build_inputs()
    split_logits, relay = run_split_forward(tiny_model, split_inputs, cuts)
    backward_split(next_token_loss(split_logits, split_inputs.labels), relay)
    split_grads = {name: p.grad.clone() for name, p in tiny_model.named_parameters() if p.grad is not None}

    tiny_model.zero_grad()
    inputs = build_inputs()
    logits = monolithic_logits(tiny_model, inputs)
    next_token_loss(logits, inputs.labels).backward()
    grads = {name: p.grad for name, p in tiny_model.named_parameters() if p.grad is not None}

    real = inputs.attention_mask.bool()
    torch.testing.assert_close(split_logits[real], logits[real], **TOLERANCE)
    assert split_grads.keys() == grads.keys()
    # Every trainable part in front of the cuts must have received the relayed gradient.
    assert any(name.startswith("model.vision_tower") for name in grads)
    assert any(name.startswith("model.language_model.layers.0.") for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def _hide_first_real_token(inputs: DecoderInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
    attention_mask = inputs.attention_mask.clone()
    first_real = attention_mask.argmax(-1)
    attention_mask[torch.arange(len(first_real)), first_real] = 0
    return attention_mask, inputs.position_ids


def _keep_original_patch_positions(inputs: DecoderInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
    # The alternative convention: text after the (pruned) image keeps its unpruned position.
    after_image = inputs.visual_token_mask.long().cumsum(-1).bool() & ~inputs.visual_token_mask
    gap = TINY.num_patches - inputs.visual_token_mask.sum(-1, keepdim=True)
    return inputs.attention_mask, inputs.position_ids + gap * after_image


def _same_positions_without_mask(inputs: DecoderInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
    # Positions with a gap and no 2D mask: read as a packed-sequence boundary.
    attention_mask, position_ids = _keep_original_patch_positions(inputs)
    return None, position_ids


@pytest.mark.parametrize(
    "corrupt",
    [_hide_first_real_token, _keep_original_patch_positions, _same_positions_without_mask],
    ids=["mask hides a real token", "positions with pruning gap", "gap without mask"],
)
def test_mask_and_positions_change_the_result(tiny_model, pixel_values, make_prompts, corrupt):
    """The equivalence tests can only catch a wrong mask or position if these matter."""
    prompts = make_prompts([1, 4, 2], [2, 0, 3])
    with torch.no_grad():
        kept = prune_randomly(vision_features(tiny_model, pixel_values), [3, 6, 9])
        visual = [project_visual_features(tiny_model, tokens) for tokens in kept]
        inputs = merge_multimodal_inputs(tiny_model, prompts, visual)

        def run(attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor:
            return run_decoder_layers(
                tiny_model, inputs.hidden_states, attention_mask, position_ids, 0, TINY.num_layers, apply_head=True
            )

        logits = run(inputs.attention_mask, inputs.position_ids)
        corrupted = run(*corrupt(inputs))
    # Only the last (real, for left padding) token of each sample: the part generation reads.
    # Well above the equivalence tolerance, so those tests would see such a mistake.
    assert (logits[:, -1] - corrupted[:, -1]).abs().max() > 10 * TOLERANCE["atol"]


def test_uniform_position_shift_is_invisible_to_rotary_attention(tiny_model, pixel_values, make_prompts):
    """Rotary attention depends on relative positions only; the previous test's changes are not this."""
    prompts = make_prompts([2], [3])
    with torch.no_grad():
        visual = project_visual_features(tiny_model, vision_features(tiny_model, pixel_values[:1]))
        inputs = merge_multimodal_inputs(tiny_model, prompts, visual)

        def run(position_ids: torch.Tensor) -> torch.Tensor:
            return run_decoder_layers(
                tiny_model, inputs.hidden_states, inputs.attention_mask, position_ids, 0, TINY.num_layers, apply_head=True
            )

        torch.testing.assert_close(run(inputs.position_ids + 7), run(inputs.position_ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("padding_side", PADDING_SIDES)
def test_merge_layout(tiny_model, make_prompts, make_answers, padding_side):
    prompts = make_prompts([1, 3], [2, 0])
    answers = make_answers([2, 1])
    visual = [torch.randn(k, TINY.hidden_size) for k in (4, 2)]
    inputs = merge_multimodal_inputs(tiny_model, prompts, visual, answers, padding_side=padding_side)
    lengths = [len(p) - 1 + len(v) + len(a) for p, v, a in zip(prompts, visual, answers, strict=True)]
    assert inputs.hidden_states.shape == (2, max(lengths), TINY.hidden_size)
    for row, length in enumerate(lengths):
        mask = inputs.attention_mask[row]
        assert int(mask.sum()) == length
        real = mask.bool()
        assert bool(real[-1] if padding_side == "left" else real[0])
        assert inputs.position_ids[row][real].tolist() == list(range(length))
        torch.testing.assert_close(inputs.hidden_states[row][inputs.visual_token_mask[row]], visual[row])
        labelled = inputs.labels[row] != IGNORE_INDEX
        assert inputs.labels[row][labelled].tolist() == answers[row].tolist()
        # Answers come last among the real tokens.
        assert labelled.nonzero().flatten().tolist() == real.nonzero().flatten()[-len(answers[row]) :].tolist()


def test_merge_leaves_masked_answer_tokens_unlabelled(tiny_model, make_prompts, make_answers):
    prompts = make_prompts([1, 3], [2, 0])
    answers = make_answers([3, 2])
    masks = [torch.tensor([True, False, True]), torch.tensor([False, True])]
    visual = [torch.randn(k, TINY.hidden_size) for k in (4, 2)]
    inputs = merge_multimodal_inputs(tiny_model, prompts, visual, answers, answer_label_masks=masks)
    for row, (answer, mask) in enumerate(zip(answers, masks, strict=True)):
        tail = inputs.labels[row][-len(answer) :]
        assert tail[mask].tolist() == answer[mask].tolist()
        assert (tail[~mask] == IGNORE_INDEX).all()
        assert int((inputs.labels[row] != IGNORE_INDEX).sum()) == int(mask.sum())


def test_merge_rejects_label_masks_that_do_not_fit_the_answers(tiny_model, make_prompts, make_answers):
    prompts, answers = make_prompts([1], [2]), make_answers([3])
    visual = [torch.randn(2, TINY.hidden_size)]
    with pytest.raises(ValueError, match="one flag per answer token"):
        merge_multimodal_inputs(tiny_model, prompts, visual, answers, answer_label_masks=[torch.tensor([True])])
    with pytest.raises(ValueError, match="needs answer_ids"):
        merge_multimodal_inputs(tiny_model, prompts, visual, answer_label_masks=[torch.tensor([True])])


@pytest.mark.parametrize("placeholders", [0, 2])
def test_merge_rejects_a_prompt_whose_placeholders_do_not_match_its_images(tiny_model, placeholders):
    prompt = torch.tensor([5, 6] + [TINY.image_token_id] * placeholders + [7])
    with pytest.raises(ValueError, match=f"{placeholders} times; it must appear exactly once per image"):
        merge_multimodal_inputs(tiny_model, [prompt], [torch.randn(3, TINY.hidden_size)])


@pytest.mark.parametrize("layer", [0, 2])
def test_decoder_attention_is_what_huggingfaces_eager_attention_returns(tiny_model, pixel_values, make_prompts, layer):
    """Whatever kernel the model runs (the fixture gives SDPA and eager), the weights are those the
    eager reference reports with output_attentions, left padding included."""
    prompts = make_prompts([2, 5, 0], [3, 1, 4])
    visual = project_visual_features(tiny_model, vision_features(tiny_model, pixel_values))
    inputs = merge_multimodal_inputs(tiny_model, prompts, visual)
    with torch.no_grad():
        hidden = inputs.hidden_states if layer == 0 else run_decoder_layers(
            tiny_model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, layer)
        weights = decoder_attention(tiny_model, hidden, inputs.attention_mask, inputs.position_ids, layer)
        eager = build_random_model(TINY, seed=0, attn_implementation="eager")
        reference = llava_parts(eager).language_model(
            inputs_embeds=inputs.hidden_states, attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids, output_attentions=True, use_cache=False,
        ).attentions[layer]
    real = inputs.attention_mask.bool()
    assert weights.shape == reference.shape
    for sample in range(len(prompts)):
        rows, columns = real[sample], real[sample]
        torch.testing.assert_close(weights[sample][:, rows][:, :, columns], reference[sample][:, rows][:, :, columns],
                                   **TOLERANCE)
    with pytest.raises(ValueError, match="decoder layer 9 does not exist"):
        decoder_attention(tiny_model, hidden, inputs.attention_mask, inputs.position_ids, 9)


def test_run_decoder_layers_rejects_bad_range(tiny_model):
    hidden = torch.zeros(1, 2, TINY.hidden_size)
    with pytest.raises(ValueError, match=r"layer range \[2, 9\)"):
        run_decoder_layers(tiny_model, hidden, torch.ones(1, 2, dtype=torch.long), torch.arange(2)[None], 2, 9)


def test_greedy_generate_matches_llava_generate(tiny_model, pixel_values, make_prompts):
    prompts = make_prompts([2, 5, 0], [3, 1, 4])
    with torch.no_grad():
        visual = project_visual_features(tiny_model, vision_features(tiny_model, pixel_values))
    generated = greedy_generate(tiny_model, prompts, visual, max_new_tokens=4)
    input_ids, attention_mask = expand_for_reference(prompts, TINY.num_patches)
    reference = tiny_model.generate(
        input_ids=input_ids,
        pixel_values=pixel_values,
        attention_mask=attention_mask,
        max_new_tokens=4,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=TINY.text["pad_token_id"],
    )[:, input_ids.shape[1] :]
    assert generated == reference.tolist()


def test_greedy_generate_stops_at_eos_and_batches_like_single_samples(tiny_model, pixel_values, make_prompts):
    prompts = make_prompts([2, 5], [3, 1])
    with torch.no_grad():
        visual = project_visual_features(tiny_model, vision_features(tiny_model, pixel_values[:2]))
    free = greedy_generate(tiny_model, prompts, visual, max_new_tokens=3)
    alone = [greedy_generate(tiny_model, [p], [v], max_new_tokens=3)[0] for p, v in zip(prompts, visual, strict=True)]
    assert free == alone
    stopped = greedy_generate(tiny_model, prompts, visual, max_new_tokens=3, eos_token_id=free[0][1])
    assert stopped[0] == free[0][:1]


@pytest.mark.parametrize("radius", [0, 1])
def test_a_local_vision_tower_keeps_each_patch_row_within_its_radius(radius):
    # mini-scenes' tower (vlm/profiles.py): a change to one patch moves only the rows within `radius`.
    profile = dataclasses.replace(TINY, name="tiny-local", vision={**TINY.vision, "patch_attention_radius": radius})
    model = build_random_model(profile, seed=0)
    grid = profile.image_size // profile.patch_size
    pixels = torch.randn(1, 3, profile.image_size, profile.image_size, generator=torch.Generator().manual_seed(0))
    changed = pixels.clone()
    row, col = 1, 2
    changed[..., row * profile.patch_size:(row + 1) * profile.patch_size, col * profile.patch_size:(col + 1) * profile.patch_size] += 1.0
    for before, after in zip(vision_hidden_states(model, pixels), vision_hidden_states(model, changed), strict=True):
        moved = ((before - after).abs().amax(-1) > 1e-6)[0].reshape(grid, grid)
        rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
        within = ((rows - row).abs() <= radius) & ((cols - col).abs() <= radius)
        assert not (moved & ~within).any()
        assert moved[row, col]
    # Without the setting the tower is CLIP's: after one layer the change reaches every row.
    clip = build_random_model(TINY, seed=0)
    last = (vision_hidden_states(clip, pixels)[-1] - vision_hidden_states(clip, changed)[-1]).abs().amax(-1)
    assert bool((last > 1e-6).all())
