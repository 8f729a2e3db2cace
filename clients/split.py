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

The run's defenses (training.defenses) act here, before the wire: ACTIVATION and LOSS
defenses on every activation the front sends (LOSS ones only in training, where their
term joins the front's backward), GRADIENT defenses on the gradient a USL client
returns at CB. Their random draws are keyed by (client, round, step), so a recomputed
front sends what the first computation sent.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from clients.runtime import ClientRuntime, KeptFront
from privacy import ACTIVATION, EVAL, LOSS, TRAIN, DefenseSeed, Payload
from privacy.per_sample import LinearSampleGradients
from pruning import PruningRecord
from training import protocol
from training.batches import EncodedSample, VisionEdge, decoder_inputs, train_positions
from vlm.segments import DecoderInputs, run_decoder_layers
from vqa import score_sample
from wire import WireError, pack_rows, unpack_rows

EVAL_SCRATCH = "eval-scratch.json"


def check_rows(what: str, rows: torch.Tensor, tokens: int) -> None:
    """The server must answer with one row per real token of this client's batch."""
    if rows.shape[0] != tokens:
        raise WireError(f"{what} from the server has {rows.shape[0]} rows; this batch has {tokens} tokens")


@dataclass
class Front:
    """One batch through the client's front: what it sends (the packed activation at the first
    cut after the defenses, in the graph), its lengths, the LOSS defenses' term, its inputs."""

    inputs: DecoderInputs
    rows: torch.Tensor
    lengths: torch.Tensor
    defense_loss: torch.Tensor | None
    pruned: PruningRecord


class SplitClient:
    """Shared steps of SL and USL clients; `front` is the owner name of the first segment."""

    front = "client"

    def __init__(self, runtime: ClientRuntime) -> None:
        self.rt = runtime
        self.front_segment = runtime.owned[self.front]

    # -- batches -------------------------------------------------------------------------
    def train_batch(self) -> list[EncodedSample]:
        rt = self.rt
        return [rt.train[p] for p in train_positions(rt.config, len(rt.train), rt.step)]

    def eval_batch(self, index: int) -> list[EncodedSample]:
        size = self.rt.config.eval.batch_size
        return self.rt.test[index * size : (index + 1) * size]

    def num_eval_batches(self) -> int:
        size = self.rt.config.eval.batch_size
        return -(-len(self.rt.test) // size)

    def inputs(self, batch: Sequence[EncodedSample], answers: Sequence[torch.Tensor],
               seed: DefenseSeed) -> tuple[DecoderInputs, PruningRecord]:
        """The batch's decoder inputs; `seed` is the step's (or evaluation batch's) defense seed,
        whose EDGE draws are the same for every greedy token of one answer."""
        rt = self.rt
        edge = VisionEdge(rt.defenses, seed.per_batch())
        return decoder_inputs(rt.model, rt.features, rt.selector, batch, answers, rt.party.device, rt.marks, edge)

    def cut_activation(self, batch: Sequence[EncodedSample], answers: Sequence[torch.Tensor], seed: DefenseSeed) -> Front:
        """The batch's activation at the first cut as it will be sent: the front, then the defenses."""
        inputs, pruned = self.inputs(batch, answers, seed)
        segment = self.front_segment
        hidden = run_decoder_layers(
            self.rt.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, segment.start, segment.stop
        )
        rows, lengths = pack_rows(hidden, inputs.attention_mask)
        stages = (ACTIVATION, LOSS) if seed.phase == TRAIN else (ACTIVATION,)
        loss = None
        if self.rt.defenses.acts_at(*stages):
            input_rows, _ = pack_rows(inputs.hidden_states, inputs.attention_mask)
            payload = Payload(rows, lengths, inputs=input_rows, front=self.front_function(lengths))
            defended = self.rt.defenses.apply(stages, payload, seed)
            rows, loss = defended.rows, defended.loss
        return Front(inputs, rows, lengths, loss, pruned)

    def front_function(self, lengths: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The front as a function of its packed input rows (what defenses that look through it use)."""
        model, segment = self.rt.model, self.front_segment

        def front(input_rows: torch.Tensor) -> torch.Tensor:
            hidden, mask, positions = unpack_rows(input_rows, lengths)
            return pack_rows(run_decoder_layers(model, hidden, mask, positions, segment.start, segment.stop), mask)[0]

        return front

    def seed(self, round_: int, step: int, phase: str = TRAIN) -> DefenseSeed:
        return self.rt.defenses.seed_for(self.rt.partition_id, round_, step, phase)

    # -- training ------------------------------------------------------------------------
    def begin(self, round_: int, committed_round: int) -> dict:
        """Start of a turn: go back to the committed state, send the first activation."""
        self.rt.begin_turn(committed_round)
        return self.forward_payload(round_)

    def train_front(self, round_: int) -> tuple[list[EncodedSample], Front]:
        batch = self.train_batch()
        return batch, self.cut_activation(batch, [item.answer_ids for item in batch], self.seed(round_, self.rt.step))

    def recorded_front(self, round_: int) -> tuple[list[EncodedSample], Front, LinearSampleGradients | None]:
        """train_front, under DP-SGD with the front's layer inputs recorded for its per-sample gradients."""
        if self.rt.dp_sgd is None:
            return (*self.train_front(round_), None)
        samples = self.rt.sample_gradients(self.front)
        with samples.recording():
            batch, front = self.train_front(round_)
        return batch, front, samples

    def forward_payload(self, round_: int) -> dict:
        """Step t's front, kept with its graph for the backward message; reply its activation."""
        batch, front, samples = self.recorded_front(round_)
        self.rt.kept_front = KeptFront(step=self.rt.step, inputs=front.inputs, rows=front.rows,
                                       defense_loss=front.defense_loss, samples=samples)
        tensors = {protocol.ROWS: front.rows.detach(), protocol.LENGTHS: front.lengths,
                   **self.extra_forward_tensors(batch)}
        return {"tensors": tensors, "metrics": front.pruned.as_message_metrics()}

    def front_of_this_step(self) -> KeptFront | None:
        """This step's kept front, if this process computed it and nothing reloaded since."""
        kept = self.rt.kept_front
        return kept if kept is not None and kept.step == self.rt.step else None

    def step_inputs(self, round_: int) -> DecoderInputs:
        """The current step's decoder inputs: kept, or recomputed without a graph."""
        kept = self.front_of_this_step()
        if kept is not None:
            return kept.inputs
        batch = self.train_batch()
        with torch.no_grad():
            inputs, _ = self.inputs(batch, [item.answer_ids for item in batch], self.seed(round_, self.rt.step))
        return inputs

    def extra_forward_tensors(self, batch: Sequence[EncodedSample]) -> dict[str, torch.Tensor]:
        return {}

    def front_backward(self, round_: int, grad_rows: torch.Tensor, go_on: bool) -> dict:
        """The gradient at the first cut arrived: finish step t, and start step t+1 in the same reply."""
        rt = self.rt
        rt.sync_private_state()
        kept = self.front_of_this_step()
        if kept is None:
            _, front, samples = self.recorded_front(round_)
            rows, defense_loss, inputs = front.rows, front.defense_loss, front.inputs
        else:
            rows, defense_loss, inputs, samples = kept.rows, kept.defense_loss, kept.inputs, kept.samples
        rt.kept_front = None
        check_rows("gradient at the first cut", grad_rows, rows.shape[0])
        optimizer = rt.optimizers[self.front]
        optimizer.zero_grad(set_to_none=True)
        grad_rows = grad_rows.to(rows.device, rows.dtype)
        if rt.dp_sgd is None:
            outputs, grads = [rows], [grad_rows]
            if defense_loss is not None:
                outputs.append(defense_loss)
                grads.append(torch.ones_like(defense_loss))
            torch.autograd.backward(outputs, grads)
        else:
            self.private_front_gradients(round_, rows, grad_rows, len(inputs.attention_mask), samples)
        optimizer.step()
        rt.step += 1
        rt.after_training_message(round_, (self.front,), end_of_turn=not go_on)
        if go_on:
            return self.forward_payload(round_)
        # The end of the turn reports this client's DP-SGD budget (none without DP-SGD).
        return {"tensors": {}, "metrics": rt.dp_sgd.spent(rt.step) if rt.dp_sgd else {}}

    def private_front_gradients(self, round_: int, rows: torch.Tensor, grad_rows: torch.Tensor, count: int,
                                samples: LinearSampleGradients) -> None:
        """DP-SGD on the front: each sample's gradient is its rows' slice backpropagated with the
        server's gradient for them (a sample's rows depend on its inputs alone) times the batch
        size — its share of the batch loss, scaled so that without clipping and noise the step is
        the plain one — clipped, summed and noised. One backward of the batch, read per sample from
        the recorded forward (privacy.per_sample)."""
        rt = self.rt
        params = rt.parameters(self.front)
        torch.autograd.grad(rows, params, grad_rows * count)
        rt.dp_sgd.private_gradients(params, samples.per_sample(count), count, rt.dp_generator(round_, self.front),
                                    clip=self.segment_clip())

    def segment_clip(self) -> float:
        """The norm each sample's gradient on the front is clipped to (USL splits it with the tail)."""
        return self.rt.dp_sgd.options.clip

    # -- evaluation: greedy answers, scored on the client ----------------------------------
    def _scratch(self) -> dict:
        return json.loads(self.rt.store.path(EVAL_SCRATCH).read_text())

    def _write_scratch(self, scratch: dict) -> None:
        self.rt.store.path(EVAL_SCRATCH).write_text(json.dumps(scratch))

    def eval_begin(self, round_: int, batch_index: int) -> dict:
        self.rt.sync_private_state()
        batch = self.eval_batch(batch_index)
        scratch = {"round": round_, "batch": batch_index, "generated": [[] for _ in batch], "finished": [False] * len(batch)}
        self._write_scratch(scratch)
        return self._eval_forward(batch, scratch)

    def _eval_forward(self, batch: Sequence[EncodedSample], scratch: dict) -> dict:
        generated = scratch["generated"]
        # Each greedy token's activation gets its own draws: keyed by the batch and the answer so far.
        seed = self.seed(scratch["round"], scratch["batch"], f"{EVAL}:{max(len(tokens) for tokens in generated)}")
        with torch.no_grad():
            front = self.cut_activation(batch, self._answers(generated), seed)
        return {"tensors": {protocol.ROWS: front.rows, protocol.LENGTHS: front.lengths}, "metrics": {}}

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
            scores = [score_sample(p, item.sample) for p, item in zip(predictions, batch, strict=True)]
            first = scratch["batch"] * self.rt.config.eval.batch_size  # eval_batch's first row
            return {"tensors": {}, "metrics": self.rt.test_scores(first, scores)}
        self._write_scratch(scratch)
        return self._eval_forward(batch, scratch)
