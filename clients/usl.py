"""USL client: private head [0, CA) and tail [CB, L) + LM head, each with its own AdamW.

The server sees the packed activation at CA and the gradient at CB — never the image,
the question, the answer, the labels or the logits: the loss is computed here. The
gradient at CB leaves through the run's GRADIENT defenses (after the tail's own update,
which uses the true gradient).
"""

import math

import torch

from clients.split import SplitClient, check_rows
from privacy import EVAL, GRADIENT, Payload
from privacy.per_sample import LinearSampleGradients
from training import protocol
from vlm.segments import next_token_loss, run_decoder_layers
from wire import unpack_rows


class USLClient(SplitClient):
    front = "head"

    def _tail(self, inputs, rows: torch.Tensor) -> torch.Tensor:
        tail = self.rt.owned["tail"]
        check_rows(protocol.ACTIVATION_AT_CB.name, rows, int(inputs.attention_mask.sum()))
        hidden, attention_mask, position_ids = unpack_rows(rows, inputs.attention_mask.sum(-1))
        return run_decoder_layers(
            self.rt.model, hidden, attention_mask, position_ids, tail.start, tail.stop, apply_head=True
        )

    def tail_step(self, round_: int, rows: torch.Tensor) -> dict:
        """Activation at CB -> tail, loss, backward, tail update; reply the gradient at CB."""
        rt = self.rt
        rt.sync_private_state()
        inputs = self.step_inputs(round_)
        rows = rows.to(rt.party.device, next(rt.model.parameters()).dtype).requires_grad_()
        samples = None
        if rt.dp_sgd is None:
            logits = self._tail(inputs, rows)
        else:
            samples = rt.sample_gradients("tail")
            with samples.recording():
                logits = self._tail(inputs, rows)
        loss = next_token_loss(logits, inputs.labels)
        optimizer = rt.optimizers["tail"]
        optimizer.zero_grad(set_to_none=True)
        if rt.dp_sgd is None:
            loss.backward()
            grad = rows.grad
        else:
            # The gradient at CB is the batch loss's, as without DP-SGD (DP-SGD protects the weights).
            (grad,) = torch.autograd.grad(loss, rows, retain_graph=True)
            self.private_tail_gradients(round_, loss, inputs.labels.shape[0], samples)
        optimizer.step()
        rt.after_training_message(round_, ("tail",), end_of_turn=False)
        if rt.defenses.acts_at(GRADIENT):
            payload = Payload(grad, inputs.attention_mask.sum(-1))
            grad = rt.defenses.apply((GRADIENT,), payload, self.seed(round_, rt.step)).rows
        return {"tensors": {protocol.GRAD: grad}, "metrics": {"loss": loss.detach().item()}}

    def private_tail_gradients(self, round_: int, loss: torch.Tensor, count: int,
                               samples: LinearSampleGradients) -> None:
        """DP-SGD on the tail: each sample's share of the batch loss times the batch size (as the
        head's, clients.split), its gradient clipped to clip/√2, summed and noised. The shares sum to
        the batch loss times the batch size (a mean over the batch's answer tokens), so one backward
        of that, read per sample from the recorded forward (privacy.per_sample)."""
        rt = self.rt
        params = rt.parameters("tail")
        torch.autograd.grad(loss * count, params)
        rt.dp_sgd.private_gradients(params, samples.per_sample(count), count, rt.dp_generator(round_, "tail"),
                                    clip=self.segment_clip())

    def segment_clip(self) -> float:
        """Head and tail each clip a sample's gradient to clip/√2: together within clip, so one
        step is one Gaussian release at noise multiplier z (privacy.dp_sgd)."""
        return self.rt.dp_sgd.options.clip / math.sqrt(2)

    def eval_tail(self, rows: torch.Tensor) -> dict:
        scratch = self._scratch()
        batch = self.eval_batch(scratch["batch"])
        with torch.no_grad():
            inputs, _ = self.inputs(batch, self._answers(scratch["generated"]),
                                    self.seed(scratch["round"], scratch["batch"], EVAL))
            rows = rows.to(self.rt.party.device, next(self.rt.model.parameters()).dtype)
            next_tokens = self._tail(inputs, rows)[:, -1].argmax(-1).tolist()
        return self.eval_advance(next_tokens)
