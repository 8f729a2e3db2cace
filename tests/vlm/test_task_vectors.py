"""Task vectors: the heads read are the heads' outputs at the last token (against attention done
by hand), replacement touches only the selected heads at the last token, chunks batch like
single prompts, and REINFORCE finds the one head whose replacement raises the answer."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vlm.profiles import TINY
from vlm.segments import llava_parts, merge_multimodal_inputs, run_decoder_layers
from vlm.task_vectors import (
    FirstAnswerToken,
    LastTokenHeads,
    ReinforceSettings,
    chunk_activations,
    head_layout,
    in_context_inputs,
    reinforce_head_mask,
    replaced_heads,
)


def _chunks(samples, shots, count):
    return [samples[i * (shots + 1) : (i + 1) * (shots + 1)] for i in range(count)]


def _inputs(tiny_answerer, chunk):
    model, tokenizer, features, _ = tiny_answerer
    return in_context_inputs(model, tokenizer, features, [chunk[-1]], [chunk[:-1]], None)


def _heads_by_hand(model, inputs, layer):
    """Layer `layer`'s per-head attention output at the last token, computed from its input."""
    parts = llava_parts(model)
    attention = parts.language_model.layers[layer].self_attn
    config = parts.language_model.config
    hidden = inputs.hidden_states if layer == 0 else run_decoder_layers(
        model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, layer)
    x = parts.language_model.layers[layer].input_layernorm(hidden)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    q = attention.q_proj(x).view(1, -1, heads, head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(1, -1, kv_heads, head_dim).transpose(1, 2)
    v = attention.v_proj(x).view(1, -1, kv_heads, head_dim).transpose(1, 2)
    cos, sin = parts.language_model.rotary_emb(hidden, position_ids=inputs.position_ids)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    weights = (q[:, :, -1:] @ k.transpose(-1, -2) / head_dim**0.5).softmax(-1)  # the last query sees every key
    return (weights @ v)[0, :, 0]  # [heads, head_dim]


def test_the_reader_holds_each_heads_output_at_the_last_token(tiny_answerer):
    model = tiny_answerer[0]
    layout = head_layout(model)
    inputs = _inputs(tiny_answerer, tiny_answerer[3][:3])
    with torch.no_grad(), LastTokenHeads(model, layout) as reader:
        run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, TINY.num_layers)
        read = reader.activations()
        assert read.shape == (1, TINY.num_layers, 2, TINY.hidden_size // 2)
        for slot, layer in enumerate(layout.layers):
            torch.testing.assert_close(read[0, slot], _heads_by_hand(model, inputs, layer), atol=1e-5, rtol=1e-4)


def test_replacement_changes_only_the_selected_heads_at_the_last_token(tiny_answerer):
    model = tiny_answerer[0]
    layout = head_layout(model, [2, 3])
    inputs = _inputs(tiny_answerer, tiny_answerer[3][:3])
    values = torch.randn(layout.shape, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(layout.shape[:2], dtype=torch.bool)
    mask[0, 1] = True  # layer 2, head 1

    def forward():
        with torch.no_grad(), LastTokenHeads(model, layout) as reader:
            hidden = run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                                        TINY.num_layers)
            return hidden, reader.activations()[0]

    plain_hidden, plain = forward()
    with replaced_heads(model, layout, values, mask):
        hidden, replaced = forward()  # the reader hooks after the writer, so it sees the replaced heads
    torch.testing.assert_close(replaced[0, 1], values[0, 1])
    torch.testing.assert_close(replaced[0, 0], plain[0, 0])  # layer 2's other head
    assert not torch.allclose(replaced[1], plain[1])  # layer 3 reads the changed last token
    torch.testing.assert_close(hidden[:, :-1], plain_hidden[:, :-1], atol=0, rtol=0)  # causal: earlier rows untouched
    assert not torch.allclose(hidden[:, -1], plain_hidden[:, -1])
    with pytest.raises(ValueError, match=r"the layout needs \(2, 2, 16\)"):
        with replaced_heads(model, layout, values[:1], mask):
            pass


def test_in_generation_the_query_token_stays_replaced_and_the_answer_tokens_are_not(tiny_answerer):
    model = tiny_answerer[0]
    layout = head_layout(model, [3])
    inputs = _inputs(tiny_answerer, tiny_answerer[3][:2])
    values = torch.full(layout.shape, 7.0)
    mask = torch.ones(layout.shape[:2], dtype=torch.bool)
    seen = []
    o_proj = llava_parts(model).language_model.layers[3].self_attn.o_proj
    appended = torch.cat([inputs.hidden_states, inputs.hidden_states[:, -1:]], dim=1)  # one answer token more
    length = inputs.hidden_states.shape[1]
    with torch.no_grad(), replaced_heads(model, layout, values, mask):
        hook = o_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
        run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, 4)
        run_decoder_layers(model, appended, torch.ones(1, length + 1, dtype=torch.long),
                           torch.arange(length + 1)[None], 0, 4)
        hook.remove()
    assert torch.equal(seen[0][0, -1], torch.full((layout.numel,), 7.0))
    assert torch.equal(seen[1][0, length - 1], torch.full((layout.numel,), 7.0))  # the query token, still
    assert not torch.equal(seen[1][0, length], torch.full((layout.numel,), 7.0))  # the answer token


def test_chunks_in_a_batch_read_as_each_chunk_alone(tiny_answerer):
    model, tokenizer, features, samples = tiny_answerer
    layout = head_layout(model, [1, 3])
    chunks = [samples[0:3], samples[3:5], samples[5:9]]  # 2, 1 and 3 demonstrations: uneven lengths
    batched = chunk_activations(model, tokenizer, features, chunks, layout, instruction=None, batch_size=3,
                                progress=False)
    alone = torch.cat([chunk_activations(model, tokenizer, features, [c], layout, instruction=None, progress=False)
                       for c in chunks])
    assert batched.shape == (3, *layout.shape)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)


def test_a_layout_outside_the_decoder_is_refused(tiny_answerer):
    with pytest.raises(ValueError, match=r"layers=\[3, 1\]: need distinct, increasing decoder layers in \[0, 4\)"):
        head_layout(tiny_answerer[0], [3, 1])


def test_reinforce_finds_the_head_whose_replacement_raises_the_answer(tiny_answerer):
    model, tokenizer, features, samples = tiny_answerer
    layout = head_layout(model)
    queries = [s for s in samples if s.answer == "yes"][:8]
    answer = tokenizer(" yes")["input_ids"][0]
    parts = llava_parts(model)
    # Layer 3, head 0's value, written through o_proj into the last row, points at "yes" in the LM head.
    o_proj = parts.language_model.layers[3].self_attn.o_proj.weight[:, : layout.head_dim]
    values = torch.zeros(layout.shape)
    values[3, 0] = 50 * o_proj.T @ parts.lm_head.weight[answer]
    before = FirstAnswerToken(model, tokenizer, features, queries, instruction=None).log_likelihood().mean()
    mask, rewards = reinforce_head_mask(
        model, tokenizer, features, queries, layout, values,
        ReinforceSettings(steps=25, batch_size=4, samples_per_step=6, lr=0.3),
        instruction=None, generator=torch.Generator().manual_seed(0), progress=False,
    )
    assert mask[3, 0]
    with torch.no_grad(), replaced_heads(model, layout, values, mask):
        after = FirstAnswerToken(model, tokenizer, features, queries, instruction=None).log_likelihood().mean()
    # The random model's small weights bound how far one head can move a logit.
    assert after > before + 0.1
    assert rewards[-1] > rewards[0]


def test_the_paper_scale_model_reads_and_writes_its_1024_heads_on_the_meta_device():
    """LLaVA-1.5-7B's task vector is 32 layers × 32 heads × 128 numbers; the hooks run on its
    real module tree (meta tensors: shapes only, no weights)."""
    from vlm.loading import build_model_on_meta
    from vlm.profiles import LLAVA_15_7B

    model = build_model_on_meta(LLAVA_15_7B)
    layout = head_layout(model)
    assert layout.shape == (32, 32, 128) and layout.numel == 131_072
    two = head_layout(model, [0, 1])
    language_model = llava_parts(model).language_model
    hidden = torch.empty(1, 5, 4096, device="meta")
    positions = torch.arange(5, device="meta")[None]
    rotary = language_model.rotary_emb(hidden, position_ids=positions)
    with torch.no_grad(), replaced_heads(model, two, torch.zeros(two.shape, device="meta"),
                                         torch.ones(two.shape[:2], dtype=torch.bool)):
        with LastTokenHeads(model, two) as reader:
            for layer in (0, 1):  # each decoder layer as run_decoder_layers calls it
                hidden = language_model.layers[layer](hidden, attention_mask=None, position_ids=positions,
                                                      position_embeddings=rotary, use_cache=False)
            assert hidden.shape == (1, 5, 4096)
            assert reader.activations().shape == (1, 2, 32, 128)
