"""The client's side of split learning (SL: one cut; USL: two cuts).

A client runs everything in front of the first cut (vision features, the token
selector, projector, embeddings, decoder layers [0, first cut)); in USL it also runs
the tail after the second cut with the LM head and the loss. Only the packed hidden
states at a cut and their gradients leave it — in SL also the answer tokens, since
there the labels sit on the server.

Every method is one message. Nothing is kept in memory between messages: a backward
pass re-runs the front's forward on the same batch (the batch of step s is fixed by
the seed, and the front's weights have not changed since), which gives the gradient
the kept graph would have given.
"""

import json
from collections.abc import Sequence

import torch

from clients.runtime import ClientRuntime
from pruning import PruningRecord
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
        self.rt.store.begin_round(committed_round)
        self.rt.sync_private_state()
        return self.forward_payload()

    def forward_payload(self) -> dict:
        batch = self.train_batch()
        with torch.no_grad():
            inputs, hidden, pruned = self.front_forward(batch, [item.answer_ids for item in batch])
        rows, lengths = pack_rows(hidden, inputs.attention_mask)
        return {"tensors": {"rows": rows, "lengths": lengths, **self.extra_forward_tensors(batch)},
                "metrics": pruned.as_message_metrics()}

    def extra_forward_tensors(self, batch: Sequence[EncodedSample]) -> dict[str, torch.Tensor]:
        return {}

    def front_backward(self, round_: int, grad_rows: torch.Tensor, go_on: bool) -> dict:
        """The gradient at the first cut arrived: finish step t, and start step t+1 in the same reply."""
        rt = self.rt
        rt.sync_private_state()
        batch = self.train_batch()
        inputs, hidden, _ = self.front_forward(batch, [item.answer_ids for item in batch])
        rows, _ = pack_rows(hidden, inputs.attention_mask)
        check_rows("gradient at the first cut", grad_rows, rows.shape[0])
        optimizer = rt.optimizers[self.front]
        optimizer.zero_grad(set_to_none=True)
        rows.backward(grad_rows.to(rows.device, rows.dtype))
        optimizer.step()
        rt.step += 1
        rt.save_private_state(round_, owners=(self.front,))
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
        return {"tensors": {"rows": rows, "lengths": lengths}, "metrics": {}}

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
