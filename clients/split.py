"""The client's side of split learning (SL: one cut; USL: two cuts).

A client runs everything in front of the first cut (vision features, the token
selector, projector, embeddings, decoder layers [0, first cut)); in USL it also runs
the tail after the second cut with the LM head and the loss. Only the packed hidden
states at a cut and their gradients leave it — in SL also the answer tokens, since
there the labels sit on the server.

Every method is one message. In a warm process the forward message keeps the front's
autograd graph and the step's decoder inputs (clients.runtime.KeptFront) until the
backward message, which backpropagates through it; USL's tail step reuses the kept
inputs. A process without them for this step (a fresh one, in deployment) re-runs the
front's forward on the same batch (the batch of step s is fixed by the seed, and the
front's weights have not changed since), which gives the gradient the kept graph gives.
"""

import json
from collections.abc import Sequence

import torch

from clients.runtime import ClientRuntime, KeptFront
from pruning import PruningRecord
from training import protocol
from training.batches import EncodedSample, batch_positions, decoder_inputs
from vlm.segments import DecoderInputs, run_decoder_layers
from vqa import score_sample
from wire import WireError, pack_rows

EVAL_SCRATCH = "eval-scratch.json"


def check_rows(what: str, rows: torch.Tensor, tokens: int) -> None:
    """The server must answer with one row per real token of this client's batch."""
    if rows.shape[0] != tokens:
        raise WireError(f"{what} from the server has {rows.shape[0]} rows; this batch has {tokens} tokens")


class SplitClient:
    """Shared steps of SL and USL clients; `front` is the owner name of the first segment."""

    front = "client"

    def __init__(self, runtime: ClientRuntime) -> None:
        self.rt = runtime
        self.front_segment = runtime.owned[self.front]

    # -- batches -------------------------------------------------------------------------
    def train_batch(self) -> list[EncodedSample]:
        rt = self.rt
        positions = batch_positions(len(rt.train), rt.config.train.batch_size, rt.step, rt.config.model.seed)
        return [rt.train[p] for p in positions]

    def eval_batch(self, index: int) -> list[EncodedSample]:
        size = self.rt.config.eval.batch_size
        return self.rt.test[index * size : (index + 1) * size]

    def num_eval_batches(self) -> int:
        size = self.rt.config.eval.batch_size
        return -(-len(self.rt.test) // size)

    def inputs(self, batch: Sequence[EncodedSample], answers: Sequence[torch.Tensor]) -> tuple[DecoderInputs, PruningRecord]:
        rt = self.rt
        return decoder_inputs(rt.model, rt.features, rt.selector, batch, answers, rt.party.device, rt.marks)

    def front_forward(
        self, batch: Sequence[EncodedSample], answers: Sequence[torch.Tensor]
    ) -> tuple[DecoderInputs, torch.Tensor, PruningRecord]:
        inputs, pruned = self.inputs(batch, answers)
        hidden = run_decoder_layers(
            self.rt.model,
            inputs.hidden_states,
            inputs.attention_mask,
            inputs.position_ids,
            self.front_segment.start,
            self.front_segment.stop,
        )
        return inputs, hidden, pruned

    # -- training ------------------------------------------------------------------------
    def begin(self, round_: int, committed_round: int) -> dict:
        """Start of a turn: go back to the committed state, send the first activation."""
        self.rt.begin_turn(committed_round)
        return self.forward_payload()

    def forward_payload(self) -> dict:
        """Step t's front, kept with its graph for the backward message; reply its activation."""
        batch = self.train_batch()
        inputs, hidden, pruned = self.front_forward(batch, [item.answer_ids for item in batch])
        rows, lengths = pack_rows(hidden, inputs.attention_mask)
        self.rt.kept_front = KeptFront(step=self.rt.step, inputs=inputs, rows=rows)
        return {"tensors": {protocol.ROWS: rows.detach(), protocol.LENGTHS: lengths, **self.extra_forward_tensors(batch)},
                "metrics": pruned.as_message_metrics()}

    def front_of_this_step(self) -> KeptFront | None:
        """This step's kept front, if this process computed it and nothing reloaded since."""
        kept = self.rt.kept_front
        return kept if kept is not None and kept.step == self.rt.step else None

    def step_inputs(self) -> DecoderInputs:
        """The current step's decoder inputs: kept, or recomputed without a graph."""
        kept = self.front_of_this_step()
        if kept is not None:
            return kept.inputs
        batch = self.train_batch()
        with torch.no_grad():
            inputs, _ = self.inputs(batch, [item.answer_ids for item in batch])
        return inputs

    def extra_forward_tensors(self, batch: Sequence[EncodedSample]) -> dict[str, torch.Tensor]:
        return {}

    def front_backward(self, round_: int, grad_rows: torch.Tensor, go_on: bool) -> dict:
        """The gradient at the first cut arrived: finish step t, and start step t+1 in the same reply."""
        rt = self.rt
        rt.sync_private_state()
        kept = self.front_of_this_step()
        if kept is None:
            batch = self.train_batch()
            inputs, hidden, _ = self.front_forward(batch, [item.answer_ids for item in batch])
            rows, _ = pack_rows(hidden, inputs.attention_mask)
        else:
            rows = kept.rows
        rt.kept_front = None
        check_rows("gradient at the first cut", grad_rows, rows.shape[0])
        optimizer = rt.optimizers[self.front]
        optimizer.zero_grad(set_to_none=True)
        rows.backward(grad_rows.to(rows.device, rows.dtype))
        optimizer.step()
        rt.step += 1
        rt.after_training_message(round_, (self.front,), end_of_turn=not go_on)
        return self.forward_payload() if go_on else {"tensors": {}, "metrics": {}}

    # -- evaluation: greedy answers, scored on the client ----------------------------------
    def _scratch(self) -> dict:
        return json.loads(self.rt.store.path(EVAL_SCRATCH).read_text())

    def _write_scratch(self, scratch: dict) -> None:
        self.rt.store.path(EVAL_SCRATCH).write_text(json.dumps(scratch))

    def eval_begin(self, batch_index: int) -> dict:
        self.rt.sync_private_state()
        batch = self.eval_batch(batch_index)
        self._write_scratch({"batch": batch_index, "generated": [[] for _ in batch], "finished": [False] * len(batch)})
        return self._eval_forward(batch, [[] for _ in batch])

    def _eval_forward(self, batch: Sequence[EncodedSample], generated: list[list[int]]) -> dict:
        with torch.no_grad():
            inputs, hidden, _ = self.front_forward(batch, self._answers(generated))
        rows, lengths = pack_rows(hidden, inputs.attention_mask)
        return {"tensors": {protocol.ROWS: rows, protocol.LENGTHS: lengths}, "metrics": {}}

    def _answers(self, generated: list[list[int]]) -> list[torch.Tensor]:
        return [torch.tensor(tokens, dtype=torch.long) for tokens in generated]

    def eval_advance(self, next_tokens: Sequence[int]) -> dict:
        """Append the chosen tokens; reply the next activation, or the batch's score when done."""
        scratch = self._scratch()
        batch = self.eval_batch(scratch["batch"])
        eos = self.rt.tokenizer.eos_token_id
        for i, token in enumerate(next_tokens):
            if scratch["finished"][i]:
                continue
            if token == eos:
                scratch["finished"][i] = True
            else:
                scratch["generated"][i].append(int(token))
        longest = max(len(tokens) for tokens in scratch["generated"])
        if all(scratch["finished"]) or longest >= self.rt.config.eval.max_new_tokens:
            predictions = [self.rt.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in scratch["generated"]]
            correct = sum(score_sample(p, item.sample) for p, item in zip(predictions, batch, strict=True))
            return {"tensors": {}, "metrics": {"correct": float(correct), "count": float(len(batch))}}
        self._write_scratch(scratch)
        return self._eval_forward(batch, scratch["generated"])
