"""Whole-model training on one client: CL's single trainer and FL's local epochs.

Both train every decoder layer's LoRA on local data; they differ in where the
adapters and the optimiser live between rounds (CL: the client's private store;
FL: the adapters come from the server each round and AdamW starts fresh).
"""

import torch

from clients.runtime import ClientRuntime
from pruning import PruningRecord
from training.batches import decoder_inputs, projected_visual_tokens, train_positions
from vlm.segments import greedy_generate, next_token_loss, run_decoder_layers
from vqa import score_sample


def train_steps(rt: ClientRuntime, optimizer: torch.optim.Optimizer, steps: int, grad_accum: int, round_: int) -> dict:
    """`steps` optimiser steps of `grad_accum` micro-batches each (DP-SGD: one, privatised); the
    mean loss, what pruning did and, under DP-SGD, the client's budget after them."""
    config = rt.config
    total, pruned = 0.0, PruningRecord(num_patches=rt.party.bundle.profile.num_patches)
    dp_metrics: dict[str, float] = {}
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(grad_accum):
            batch = [rt.train[p] for p in train_positions(config, len(rt.train), rt.step * grad_accum + micro)]
            if rt.dp_sgd is None:
                loss, batch_pruned = _loss(rt, batch)
                pruned = pruned.merge(batch_pruned)
                (loss / grad_accum).backward()
                total += loss.item() / grad_accum
                continue
            # DP-SGD: each sample's own forward and gradient, clipped, summed and noised.
            params, losses, parts = rt.parameters("all"), [], []
            dp_metrics = rt.dp_sgd.private_gradients(
                params, _sample_gradients(rt, batch, params, losses, parts), len(batch), rt.dp_generator(round_, "all")
            )
            for part in parts:
                pruned = pruned.merge(part)
            total += sum(losses)
        optimizer.step()
        rt.step += 1
    if rt.dp_sgd is not None:
        dp_metrics.update(rt.dp_sgd.spent(rt.step))
    return {
        "loss": total / steps,
        **pruned.as_message_metrics(),
        "num-examples": float(steps * grad_accum * config.train.batch_size),
        **dp_metrics,
    }


def _sample_gradients(rt: ClientRuntime, batch: list, params: list, losses: list, pruned: list):
    """Each sample's gradient for `params`, one forward and backward at a time: of its share of
    the batch loss (a mean over the batch's answer tokens) times the batch size, so that without
    clipping and noise the step is the plain one. Its share and pruning record are appended to
    `losses` and `pruned`."""
    tokens = [item.answer_ids.numel() for item in batch]
    for item, count in zip(batch, tokens, strict=True):
        loss, sample_pruned = _loss(rt, [item])
        share = loss * count / sum(tokens)
        losses.append(share.item())
        pruned.append(sample_pruned)
        yield torch.autograd.grad(share * len(batch), params)


def _loss(rt: ClientRuntime, batch: list) -> tuple[torch.Tensor, PruningRecord]:
    """The whole model's next-token loss on `batch`, and what pruning did to it."""
    inputs, pruned = decoder_inputs(
        rt.model, rt.features, rt.selector, batch, [item.answer_ids for item in batch], rt.party.device, rt.marks
    )
    logits = run_decoder_layers(
        rt.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, rt.party.segments[0].stop,
        apply_head=True,
    )
    return next_token_loss(logits, inputs.labels), pruned


@torch.no_grad()
def evaluate_local(rt: ClientRuntime) -> dict:
    """Greedy answers on the client's test share, scored (ClientRuntime.test_scores)."""
    config, model = rt.config, rt.model
    scores = []
    for start in range(0, len(rt.test), config.eval.batch_size):
        batch = rt.test[start : start + config.eval.batch_size]
        visual, _ = projected_visual_tokens(model, rt.features, rt.selector, batch, rt.party.device, rt.marks)
        generated = greedy_generate(
            model, [item.prompt_ids for item in batch], visual,
            max_new_tokens=config.eval.max_new_tokens, eos_token_id=rt.tokenizer.eos_token_id,
        )
        for tokens, item in zip(generated, batch, strict=True):
            scores.append(score_sample(rt.tokenizer.decode(tokens, skip_special_tokens=True), item.sample))
    return rt.test_scores(0, scores)
