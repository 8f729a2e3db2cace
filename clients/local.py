"""Whole-model training on one client: CL's single trainer and FL's local epochs.

Both train every decoder layer's LoRA on local data; they differ in where the
adapters and the optimiser live between rounds (CL: the client's private store;
FL: the adapters come from the server each round and AdamW starts fresh).
"""

import torch

from clients.runtime import ClientRuntime
from pruning import PruningRecord
from training.batches import batch_positions, decoder_inputs, projected_visual_tokens
from vlm.segments import greedy_generate, next_token_loss, run_decoder_layers
from vqa import score_sample


def train_steps(rt: ClientRuntime, optimizer: torch.optim.Optimizer, steps: int, grad_accum: int) -> dict:
    """`steps` optimiser steps of `grad_accum` micro-batches each; the mean loss and what pruning did."""
    config, model = rt.config, rt.model
    total, pruned = 0.0, PruningRecord(num_patches=rt.party.bundle.profile.num_patches)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(grad_accum):
            positions = batch_positions(
                len(rt.train), config.train.batch_size, rt.step * grad_accum + micro, config.model.seed
            )
            batch = [rt.train[p] for p in positions]
            inputs, batch_pruned = decoder_inputs(
                model, rt.features, rt.selector, batch, [item.answer_ids for item in batch], rt.party.device, rt.marks
            )
            pruned = pruned.merge(batch_pruned)
            logits = run_decoder_layers(
                model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                rt.party.segments[0].stop, apply_head=True,
            )
            loss = next_token_loss(logits, inputs.labels) / grad_accum
            loss.backward()
            total += loss.item()
        optimizer.step()
        rt.step += 1
    return {
        "loss": total / steps,
        **pruned.as_message_metrics(),
        "num-examples": float(steps * grad_accum * config.train.batch_size),
    }


@torch.no_grad()
def evaluate_local(rt: ClientRuntime) -> dict:
    """Greedy answers on the client's test share; the summed score and the count."""
    config, model = rt.config, rt.model
    correct = 0.0
    for start in range(0, len(rt.test), config.eval.batch_size):
        batch = rt.test[start : start + config.eval.batch_size]
        visual, _ = projected_visual_tokens(model, rt.features, rt.selector, batch, rt.party.device, rt.marks)
        generated = greedy_generate(
            model, [item.prompt_ids for item in batch], visual,
            max_new_tokens=config.eval.max_new_tokens, eos_token_id=rt.tokenizer.eos_token_id,
        )
        for tokens, item in zip(generated, batch, strict=True):
            correct += score_sample(rt.tokenizer.decode(tokens, skip_special_tokens=True), item.sample)
    return {"correct": correct, "count": float(len(rt.test))}
