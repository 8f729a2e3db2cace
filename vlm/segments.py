"""LLaVA-1.5 taken apart into the pieces a split system runs on different parties.

Pruning sits between the vision tower and the projector, and split learning cuts
the decoder, so the rest of the system calls these pieces instead of
LlavaForConditionalGeneration.forward. Composed, they reproduce that forward (and
its gradients) exactly: tests/vlm/test_segments.py holds them to it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlavaConfig, LlavaForConditionalGeneration
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from vlm.cuts import LayerSegment

IGNORE_INDEX = -100
PADDING_SIDES = ("left", "right")


@dataclass(frozen=True)
class LlavaParts:
    """The modules of one LLaVA model, found through any wrapper (e.g. peft)."""

    vision_tower: nn.Module
    projector: nn.Module
    language_model: nn.Module
    lm_head: nn.Linear
    config: LlavaConfig

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)


def llava_parts(model: nn.Module) -> LlavaParts:
    """Locate the LLaVA modules in a plain or peft-wrapped LlavaForConditionalGeneration."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, LlavaForConditionalGeneration):
        raise TypeError(
            f"expected a LlavaForConditionalGeneration (optionally peft-wrapped), got {type(model).__name__}"
        )
    return LlavaParts(
        vision_tower=base.model.vision_tower,
        projector=base.model.multi_modal_projector,
        language_model=base.model.language_model,
        lm_head=base.lm_head,
        config=base.config,
    )


def local_attention_mask(vision_config, embeddings: torch.Tensor) -> torch.Tensor | None:
    """The additive attention mask [1, 1, 1 + N, 1 + N] of a vision tower whose patch rows stay
    local, or None for CLIP's global attention.

    `patch_attention_radius` (a profile's vision setting, kept in the vision config) lets a patch
    row attend only to patches within that Chebyshev distance on the grid: 0 keeps each row a
    function of its own patch, so removing a patch removes its content (vlm/profiles.py,
    mini-scenes). The CLS row may read every row, but no patch row reads it, since it would
    carry the whole image back into every patch.
    """
    radius = getattr(vision_config, "patch_attention_radius", None)
    if radius is None:
        return None
    grid = vision_config.image_size // vision_config.patch_size
    rows, cols = torch.arange(grid).repeat_interleave(grid), torch.arange(grid).repeat(grid)
    near = ((rows[:, None] - rows[None, :]).abs() <= radius) & ((cols[:, None] - cols[None, :]).abs() <= radius)
    allowed = torch.ones(grid * grid + 1, grid * grid + 1, dtype=torch.bool)
    allowed[1:, 1:] = near
    allowed[1:, 0] = False
    mask = torch.zeros(allowed.shape, dtype=embeddings.dtype, device=embeddings.device)
    return mask.masked_fill(~allowed.to(embeddings.device), torch.finfo(embeddings.dtype).min)[None, None]


def vision_hidden_states(model: nn.Module, pixel_values: torch.Tensor, tower: nn.Module | None = None) -> list[torch.Tensor]:
    """The patch rows [B, N, Dv] the vision tower holds after its embeddings (index 0) and
    after each layer up to the configured vision feature layer (the last entry is what
    LLaVA reads); the CLS row is dropped as LLaVA's "default" feature selection drops it.

    Only the CLIP layers up to the selected one run: the later layers (and the
    post-layernorm, which only feeds the pooled output) would be wasted compute. `tower`
    replaces the model's own vision tower (a defended edge's, privacy.positionless).
    """
    parts = llava_parts(model)
    feature_layer = parts.config.vision_feature_layer
    if not isinstance(feature_layer, int):
        raise ValueError(
            f"vision_feature_layer={feature_layer!r}: only a single int layer is supported by the split model"
        )
    tower = parts.vision_tower if tower is None else tower
    encoder_layers = tower.encoder.layers
    # hidden_states[0] is the (pre-layernormed) embedding output, hidden_states[i] the output of layer i.
    layers_to_run = feature_layer % (len(encoder_layers) + 1)
    hidden_states = [tower.pre_layrnorm(tower.embeddings(pixel_values))]
    mask = local_attention_mask(parts.config.vision_config, hidden_states[0])
    for layer in encoder_layers[:layers_to_run]:
        hidden_states.append(layer(hidden_states[-1], mask))
    if parts.config.vision_feature_select_strategy == "default":
        return [h[:, 1:] for h in hidden_states]
    return hidden_states


@dataclass
class FeatureLayerAttention:
    """What the vision feature layer's self-attention reads (VisionZip's inputs): `cls` [B, N],
    the attention the CLS row pays each patch row, summed over heads; `keys` [B, N, Dh], the
    patch rows' keys averaged over heads."""

    cls: torch.Tensor
    keys: torch.Tensor


def feature_layer_attention(model: nn.Module, pixel_values: torch.Tensor) -> FeatureLayerAttention:
    """The self-attention of the vision layer whose output LLaVA reads, from its query and key
    projections (the layer's forward returns no weights): run the layers before it as
    `vision_hidden_states` does, then softmax(q kᵀ · scale + mask) of that layer's input."""
    parts = llava_parts(model)
    if parts.config.vision_feature_select_strategy != "default":
        raise ValueError("feature_layer_attention reads patch rows behind a CLS row: it needs "
                         f"vision_feature_select_strategy='default', not {parts.config.vision_feature_select_strategy!r}")
    tower = parts.vision_tower
    layers = tower.encoder.layers
    layer_index = parts.config.vision_feature_layer % (len(layers) + 1) - 1
    if layer_index < 0:
        raise ValueError("the vision feature layer is the embeddings: no attention layer produced the features")
    hidden = tower.pre_layrnorm(tower.embeddings(pixel_values))
    mask = local_attention_mask(parts.config.vision_config, hidden)
    for layer in layers[:layer_index]:
        hidden = layer(hidden, mask)
    layer = layers[layer_index]
    attention = layer.self_attn
    inputs = layer.layer_norm1(hidden)
    batch, length, _ = inputs.shape

    def heads(projection: nn.Module) -> torch.Tensor:
        return projection(inputs).view(batch, length, attention.num_heads, attention.head_dim).transpose(1, 2)

    queries, keys = heads(attention.q_proj), heads(attention.k_proj)
    logits = queries @ keys.transpose(-1, -2) * attention.scale
    if mask is not None:
        logits = logits + mask
    weights = logits.float().softmax(-1)
    return FeatureLayerAttention(cls=weights[:, :, 0, 1:].sum(1), keys=keys[:, :, 1:].mean(1))


def vision_features(model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """Patch features [B, N, Dv] at the configured vision feature layer."""
    return vision_hidden_states(model, pixel_values)[-1]


def project_visual_features(model: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """Map (possibly pruned) patch features [B, k, Dv] into the decoder's space [B, k, D]."""
    return llava_parts(model).projector(features)


@dataclass
class DecoderInputs:
    """Everything a decoder segment needs; mask and positions travel with the hidden states."""

    hidden_states: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    visual_token_mask: torch.Tensor


# One sample's visual embeddings: [k, D] for a prompt with one image placeholder, or one
# [k_i, D] per placeholder, in order, for a multi-image prompt (in-context demonstrations).
SampleVisual = torch.Tensor | Sequence[torch.Tensor]


def _placeholder_indices(prompt: torch.Tensor, image_token_id: int, sample: int, images: int) -> list[int]:
    positions = (prompt == image_token_id).nonzero().flatten().tolist()
    if len(positions) != images:
        raise ValueError(
            f"prompt {sample} contains the image placeholder token (id {image_token_id}) "
            f"{len(positions)} times; it must appear exactly once per image ({images})"
        )
    return positions


def merge_multimodal_inputs(
    model: nn.Module,
    prompt_ids: Sequence[torch.Tensor],
    visual_embeds: Sequence[SampleVisual],
    answer_ids: Sequence[torch.Tensor] | None = None,
    *,
    answer_label_masks: Sequence[torch.Tensor] | None = None,
    padding_side: str = "left",
) -> DecoderInputs:
    """Decoder inputs from per-sample prompts, visual tokens and optional answers.

    Each prompt holds one image placeholder per image of its sample, each replaced by that
    image's k visual embeddings (k varies after pruning); a sample's visual embeddings are one
    tensor for a one-image prompt or a sequence of them, in placeholder order. Answers are appended and become the
    labels (IGNORE_INDEX elsewhere); `answer_label_masks` (one bool per answer token)
    leaves unlabelled what a multi-turn conversation's continuation holds besides
    the answers (the later turns' questions). Positions are cumsum(mask) - 1, so kept visual
    tokens are renumbered without gaps; padded slots get position 0 and mask 0.
    Left padding is the default because it puts every sample's last token in the
    last column, which is what generation reads.
    """
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side={padding_side!r}; allowed: {PADDING_SIDES}")
    if len(prompt_ids) != len(visual_embeds):
        raise ValueError(f"got {len(prompt_ids)} prompts but {len(visual_embeds)} visual token sets")
    if answer_ids is not None and len(answer_ids) != len(prompt_ids):
        raise ValueError(f"got {len(prompt_ids)} prompts but {len(answer_ids)} answers")
    if answer_label_masks is not None and (
        answer_ids is None
        or [len(mask) for mask in answer_label_masks] != [len(answer) for answer in answer_ids]
    ):
        raise ValueError("answer_label_masks needs answer_ids and one flag per answer token")
    parts = llava_parts(model)
    embed_tokens = parts.language_model.embed_tokens
    image_token_id = parts.config.image_token_id
    device, dtype = embed_tokens.weight.device, embed_tokens.weight.dtype

    sequences, label_rows, visual_rows = [], [], []
    for sample, (prompt, visual) in enumerate(zip(prompt_ids, visual_embeds, strict=True)):
        prompt = torch.as_tensor(prompt, dtype=torch.long, device=device)
        images = [visual] if isinstance(visual, torch.Tensor) else list(visual)
        placeholders = _placeholder_indices(prompt, image_token_id, sample, len(images))
        answer = (
            torch.as_tensor(answer_ids[sample], dtype=torch.long, device=device)
            if answer_ids is not None
            else prompt.new_empty(0)
        )
        is_text = prompt != image_token_id
        text_embeds = embed_tokens(torch.cat([prompt[is_text], answer]))
        pieces, visual_row, text_start = [], [], 0
        for index, (placeholder, image) in enumerate(zip(placeholders, images)):
            text_stop = placeholder - index  # the text tokens before this placeholder
            pieces += [text_embeds[text_start:text_stop], image.to(device, dtype)]
            visual_row += [False] * (text_stop - text_start) + [True] * image.shape[0]
            text_start = text_stop
        pieces.append(text_embeds[text_start:])
        visual_row += [False] * (text_embeds.shape[0] - text_start)
        sequences.append(torch.cat(pieces))
        num_unlabelled = len(visual_row) - answer.numel()
        labels_of_answer = (
            answer
            if answer_label_masks is None
            else answer.masked_fill(~torch.as_tensor(answer_label_masks[sample], device=device), IGNORE_INDEX)
        )
        label_rows.append(torch.cat([prompt.new_full((num_unlabelled,), IGNORE_INDEX), labels_of_answer]))
        visual_rows.append(torch.tensor(visual_row, dtype=torch.bool, device=device))

    length = max(sequence.shape[0] for sequence in sequences)
    batch = len(sequences)
    attention_mask = torch.zeros(batch, length, dtype=torch.long, device=device)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long, device=device)
    visual_token_mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
    rows = []
    for sample, sequence in enumerate(sequences):
        n = sequence.shape[0]
        left = padding_side == "left"
        span = slice(length - n, length) if left else slice(0, n)
        # Padded slots are zero vectors: masked out, they never reach a real token.
        rows.append(F.pad(sequence, (0, 0, length - n, 0) if left else (0, 0, 0, length - n)))
        attention_mask[sample, span] = 1
        labels[sample, span] = label_rows[sample]
        visual_token_mask[sample, span] = visual_rows[sample]
    hidden_states = torch.stack(rows)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DecoderInputs(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        labels=labels if answer_ids is not None else None,
        visual_token_mask=visual_token_mask,
    )


def run_decoder_layers(
    model: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    start: int,
    stop: int,
    *,
    apply_head: bool = False,
) -> torch.Tensor:
    """Decoder layers [start, stop); with `apply_head`, then final norm + LM head (logits).

    The causal mask and rotary cos/sin are rebuilt here from the 2D mask and the
    position ids exactly as LlamaModel.forward builds them, so each party can run
    its segment alone. Always pass the 2D mask (even all ones): without it a jump
    in position ids is read as a packed-sequence boundary.
    """
    parts = llava_parts(model)
    if not 0 <= start < stop <= parts.num_layers:
        raise ValueError(
            f"layer range [{start}, {stop}) is invalid; need 0 <= start < stop <= {parts.num_layers}"
        )
    language_model = parts.language_model
    causal_mask = create_causal_mask(
        config=language_model.config,
        inputs_embeds=hidden_states,
        attention_mask=attention_mask,
        cache=None,
        position_ids=position_ids,
    )
    position_embeddings = language_model.rotary_emb(hidden_states, position_ids=position_ids)
    for layer in language_model.layers[start:stop]:
        hidden_states = layer(
            hidden_states,
            attention_mask=causal_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            use_cache=False,
        )
    if apply_head:
        return parts.lm_head(language_model.norm(hidden_states))
    return hidden_states


def decoder_attention(
    model: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """Decoder layer `layer`'s attention weights [B, heads, L, L] over its input `hidden_states`
    (what layers [0, layer) returned), causal and padding-masked as the model runs it.

    Computed eagerly with transformers' own projections, rotary embedding and eager attention,
    whatever attention kernel the model runs with (SDPA returns no weights): the pruners that
    rank visual tokens by the attention they receive (FastV, SparseVLM) read them. Padded query
    rows hold meaningless weights; read real rows only.
    """
    parts = llava_parts(model)
    if not 0 <= layer < parts.num_layers:
        raise ValueError(f"decoder layer {layer} does not exist; the decoder has layers 0..{parts.num_layers - 1}")
    language_model = parts.language_model
    block = language_model.layers[layer]
    attention = block.self_attn
    normed = block.input_layernorm(hidden_states)
    shape = (*normed.shape[:-1], -1, attention.head_dim)
    query = attention.q_proj(normed).view(shape).transpose(1, 2)
    key = attention.k_proj(normed).view(shape).transpose(1, 2)
    cos, sin = language_model.rotary_emb(normed, position_ids=position_ids)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    length = hidden_states.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=hidden_states.device).tril()
    allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    additive = additive.masked_fill(~allowed, torch.finfo(query.dtype).min)
    # The values do not change the weights; the keys stand in for them.
    _, weights = eager_attention_forward(attention, query, key, key, additive, scaling=attention.scaling)
    return weights


def run_segment(
    model: nn.Module,
    segment: LayerSegment,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """One party's decoder segment; the last segment returns logits."""
    return run_decoder_layers(
        model,
        hidden_states,
        attention_mask,
        position_ids,
        segment.start,
        segment.stop,
        apply_head=segment.is_last,
    )


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each labelled token given the tokens before it."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompt_ids: Sequence[torch.Tensor],
    visual_embeds: Sequence[SampleVisual],
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Greedy answers (eos excluded) for scoring short answers.

    Without a KV cache each step reruns the whole sequence; that is cheap for the
    few tokens a VQA answer needs, and it reuses exactly the training code path.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    parts = llava_parts(model)
    device = parts.lm_head.weight.device
    generated: list[list[int]] = [[] for _ in prompt_ids]
    finished = [False] * len(prompt_ids)
    for _ in range(max_new_tokens):
        answers = [torch.tensor(tokens, dtype=torch.long, device=device) for tokens in generated]
        inputs = merge_multimodal_inputs(model, prompt_ids, visual_embeds, answers, padding_side="left")
        logits = run_decoder_layers(
            model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, parts.num_layers, apply_head=True
        )
        for sample, token in enumerate(logits[:, -1].argmax(-1).tolist()):
            if finished[sample]:
                continue
            if token == eos_token_id:
                finished[sample] = True
            else:
                generated[sample].append(token)
        if all(finished):
            break
    return generated
