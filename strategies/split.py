"""Sequential split learning: clients take turns against one server-side model segment.

One turn is `train.steps_per_round` steps of one client. The exchange is shaped so
each message carries as much as the math allows: the gradient for step t's front
travels with the request for step t+1's activation, so a turn of T steps costs
T+1 round trips in SL and 2T+1 in USL (1 and 2 per step, plus one to open the turn).
A client that fails loses the rest of its turn; the reason goes into the round's
record and the next client goes on.

A malicious server is the same strategy with a `CutHijack` injected (threat.model
active-fsha, strategies.adversarial): every message still flows as the protocol says,
but the server leaves its own segment untrained and answers each training activation
at the first cut with the hijack's gradient instead of its own.
"""

from abc import abstractmethod
from typing import Any, Protocol

import torch
from flwr.app import RecordDict
from flwr.serverapp import Grid

from config import SimConfig
from pruning import PruningRecord
from strategies.base import FAULTS, Outcomes, RoundStrategy, pruning_record, sample_level_budget
from strategies.callbacks import RunCallback
from training import protocol
from training.model import PartyModel, make_optimizer
from vlm.lora import load_owner_state_dict, owner_lora_parameters, owner_state_dict
from vlm.segments import IGNORE_INDEX, next_token_loss, run_decoder_layers
from wire import Wire, WireError, pack_rows, unpack_rows


class CutHijack(Protocol):
    """What a hijacking server runs instead of its segment (strategies.adversarial.FSHAHijack)."""

    def first_cut_gradient(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The gradient to return for a packed training activation at the first cut (same shape)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SplitStrategy(RoundStrategy):
    """Base of SL and USL; `owner` names the server's segment (vlm.cuts)."""

    owner = "server"

    def __init__(
        self,
        config: SimConfig,
        party: PartyModel,
        wire: Wire,
        callbacks: list[RunCallback] = (),
        hijack: CutHijack | None = None,
    ) -> None:
        super().__init__(config, wire, callbacks)
        self.party = party
        self.hijack = hijack
        self.segment = next(s for s in party.segments if s.owner == self.owner)
        self.parameters = list(owner_lora_parameters(party.model, self.segment).values())
        self.optimizer = make_optimizer(self.parameters, config)
        self.hidden_size = party.model.get_base_model().config.text_config.hidden_size

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"lora": owner_state_dict(self.party.model, self.segment), "optim": self.optimizer.state_dict()}
        if self.hijack is not None:
            state["hijack"] = self.hijack.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_owner_state_dict(self.party.model, self.segment, state["lora"])
        self.optimizer.load_state_dict(state["optim"])
        if self.hijack is not None:
            self.hijack.load_state_dict(state["hijack"])

    # -- the received activation -------------------------------------------------------------
    def receive_activation(
        self, round_: int, node: int, kind: protocol.TransferKind, content: RecordDict
    ) -> dict[str, torch.Tensor]:
        """The client's packed activation, checked for consistency before anyone sees it."""

        def consistent(tensors: dict[str, torch.Tensor]) -> None:
            lengths, rows = tensors[protocol.LENGTHS], tensors[protocol.ROWS]
            if lengths.numel() == 0 or int(lengths.min()) < 1 or int(lengths.sum()) != rows.shape[0]:
                raise WireError(
                    f"{kind.name} from client {node}: {rows.shape[0]} rows do not match the per-sample "
                    f"lengths {lengths.tolist()}"
                )
            self.check_extra(tensors, node)

        return self.receive(round_, node, kind, content, check=consistent, hidden=self.hidden_size)

    def check_extra(self, tensors: dict[str, torch.Tensor], node: int) -> None:
        """Checks of what a paradigm adds to the activation (SL: the answers)."""

    def compute_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.party.device, next(self.party.model.parameters()).dtype)

    # -- training --------------------------------------------------------------------------
    def train_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        losses, steps, tokens, budgets = [], 0, 0, []
        pruned = PruningRecord(num_patches=self.party.bundle.profile.num_patches)
        for node in nodes:
            done, turn_losses, turn_pruned, turn_tokens, budget = self.turn(grid, node, round_)
            budgets.append(budget)
            steps += done
            losses += turn_losses
            pruned = pruned.merge(turn_pruned)
            tokens += turn_tokens
        if steps == 0:
            reasons = "; ".join(f"client {f['client']}: {f['reason'][-300:]}" for f in self.faults.get(round_, []))
            raise RuntimeError(f"no client completed a step in round {round_}: {reasons}")
        return {
            "train_loss": sum(losses) / len(losses) if losses else None,
            "steps": steps,
            **pruned.as_round_metrics(),
            # Real tokens whose activations crossed the (first) cut: k in the k × D payload.
            "train_tokens": tokens,
            **sample_level_budget(budgets),
        }

    def turn(self, grid: Grid, node: int, round_: int) -> tuple[int, list[float], PruningRecord, int, dict[str, Any]]:
        """The client's turn: its steps done, losses, pruning, tokens sent, and what its end of
        turn reported (DP-SGD: its budget)."""
        steps = self.config.train.steps_per_round
        losses, done, tokens, reported = [], 0, 0, {}
        pruned = PruningRecord(num_patches=self.party.bundle.profile.num_patches)
        phase = "open the turn"
        try:
            reply = self.exchange(grid, node, round_, protocol.SPLIT_BEGIN, {"committed-round": round_ - 1})
            for step in range(steps):
                pruned = pruned.merge(pruning_record(reply))
                phase = f"step {step + 1}/{steps}"
                reply, loss, step_tokens = self.step(grid, node, round_, reply, go_on=step < steps - 1)
                losses.append(loss)
                tokens += step_tokens
                done += 1
            self.receive(round_, node, protocol.END_OF_TURN, reply)
            reported = dict(reply.metric_records[protocol.METRICS])
        except FAULTS as error:
            self.record_fault(round_, node, phase, error, f"turn skipped after {done} of {steps} steps")
        return done, losses, pruned, tokens, reported

    @abstractmethod
    def step(self, grid: Grid, node: int, round_: int, reply: RecordDict, go_on: bool) -> tuple[RecordDict, float, int]:
        """One training step from the client's activation; returns the next reply, the loss and the tokens."""

    def first_cut_gradient(
        self, received: dict[str, torch.Tensor], rows: torch.Tensor, outputs: torch.Tensor, grad_outputs: torch.Tensor | None
    ) -> torch.Tensor:
        """The gradient the client's front gets for its activation `received` (computed from `rows`).

        An honest server backpropagates from its outputs (a loss, or rows with their
        gradient), steps its segment and returns its own gradient; a hijacking one does
        neither and returns the hijack's.
        """
        if self.hijack is not None:
            return self.hijack.first_cut_gradient(received[protocol.ROWS], received[protocol.LENGTHS])
        self.optimizer.zero_grad(set_to_none=True)
        outputs.backward(grad_outputs)
        self.optimizer.step()
        return rows.grad

    # -- evaluation: greedy decoding through the cuts, scored by each client -----------------
    def evaluate_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        correct = count = 0.0
        outcomes = Outcomes()
        for node in nodes:
            try:
                batch, batches = 0, 1
                while batch < batches:
                    reply = self.exchange(grid, node, round_, protocol.EVAL_BEGIN, {"batch": batch})
                    batches = int(reply.metric_records[protocol.METRICS]["eval-batches"])
                    while "count" not in reply.metric_records[protocol.METRICS]:
                        reply = self.eval_step(grid, node, round_, reply)
                    self.receive(round_, node, protocol.EVALUATION_SCORE, reply)
                    outcomes.add(reply.metric_records[protocol.METRICS])
                    correct += reply.metric_records[protocol.METRICS]["correct"]
                    count += reply.metric_records[protocol.METRICS]["count"]
                    batch += 1
            except FAULTS as error:
                self.record_fault(round_, node, "evaluation", error, "its test share is not scored this round")
        return {"test_accuracy": correct / count if count else None, "test_count": count, **outcomes.record()}

    @abstractmethod
    def eval_step(self, grid: Grid, node: int, round_: int, reply: RecordDict) -> RecordDict:
        """One greedy token for the client's batch; returns the client's next reply."""


class USLStrategy(SplitStrategy):
    """USL: the server runs the body [CA, CB) and sees only the two cut activations' traffic."""

    owner = "body"

    def body(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.compute_rows(tensors[protocol.ROWS]).requires_grad_()
        hidden, mask, positions = unpack_rows(rows, tensors[protocol.LENGTHS])
        out = run_decoder_layers(
            self.party.model, hidden, mask, positions, self.segment.start, self.segment.stop
        )
        return rows, pack_rows(out, mask)[0]

    def step(self, grid: Grid, node: int, round_: int, reply: RecordDict, go_on: bool) -> tuple[RecordDict, float, int]:
        received = self.receive_activation(round_, node, protocol.ACTIVATION_AT_CA, reply)
        rows_in, rows_out = self.body(received)
        tail_reply = self.exchange(grid, node, round_, protocol.USL_TAIL, {}, {protocol.ROWS: rows_out})
        grad_cb = self.receive(
            round_, node, protocol.GRADIENT_AT_CB, tail_reply, rows=rows_out.shape[0], hidden=self.hidden_size
        )[protocol.GRAD]
        grad_ca = self.first_cut_gradient(received, rows_in, rows_out, self.compute_rows(grad_cb))
        loss = float(tail_reply.metric_records[protocol.METRICS]["loss"])
        next_reply = self.exchange(grid, node, round_, protocol.USL_HEAD, {"go-on": go_on}, {protocol.GRAD: grad_ca})
        return next_reply, loss, received[protocol.ROWS].shape[0]

    def eval_step(self, grid: Grid, node: int, round_: int, reply: RecordDict) -> RecordDict:
        received = self.receive_activation(round_, node, protocol.EVAL_ACTIVATION_AT_CA, reply)
        with torch.no_grad():
            _, rows_out = self.body(received)
        return self.exchange(grid, node, round_, protocol.USL_EVAL_TAIL, {}, {protocol.ROWS: rows_out})


class SLStrategy(SplitStrategy):
    """SL: the server runs [C, L) with the LM head and the loss (labels arrive with the activation)."""

    owner = "server"

    def check_extra(self, tensors: dict[str, torch.Tensor], node: int) -> None:
        # SL's labels live on the server: training activations bring the answer tokens along.
        if protocol.ANSWERS not in tensors:  # evaluation carries no answers
            return
        answer_lengths, lengths = tensors[protocol.ANSWER_LENGTHS], tensors[protocol.LENGTHS]
        if (
            answer_lengths.numel() != lengths.numel()
            or bool((answer_lengths < 1).any() | (answer_lengths > lengths).any())
            or int(answer_lengths.sum()) != tensors[protocol.ANSWERS].numel()
        ):
            raise WireError(f"answers from client {node} do not fit the samples' lengths")

    def logits(self, tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask, positions = unpack_rows(rows, tensors[protocol.LENGTHS])
        logits = run_decoder_layers(
            self.party.model, hidden, mask, positions, self.segment.start, self.segment.stop, apply_head=True
        )
        return logits, mask

    def step(self, grid: Grid, node: int, round_: int, reply: RecordDict, go_on: bool) -> tuple[RecordDict, float, int]:
        received = self.receive_activation(round_, node, protocol.ACTIVATION_AT_C, reply)
        answer_lengths = received[protocol.ANSWER_LENGTHS].to(torch.long)
        rows = self.compute_rows(received[protocol.ROWS]).requires_grad_()
        logits, mask = self.logits(received, rows)
        # Left padding puts every sample's answer (and its end token) in its last positions.
        labels = torch.full(mask.shape, IGNORE_INDEX, dtype=torch.long, device=logits.device)
        for sample, answer in enumerate(torch.split(received[protocol.ANSWERS].to(torch.long), answer_lengths.tolist())):
            labels[sample, labels.shape[1] - answer.numel() :] = answer
        loss = next_token_loss(logits, labels)
        grad = self.first_cut_gradient(received, rows, loss, None)
        next_reply = self.exchange(grid, node, round_, protocol.SL_BACKWARD, {"go-on": go_on}, {protocol.GRAD: grad})
        return next_reply, loss.detach().item(), received[protocol.ROWS].shape[0]

    def eval_step(self, grid: Grid, node: int, round_: int, reply: RecordDict) -> RecordDict:
        received = self.receive_activation(round_, node, protocol.EVAL_ACTIVATION_AT_C, reply)
        with torch.no_grad():
            logits, _ = self.logits(received, self.compute_rows(received[protocol.ROWS]))
        tokens = logits[:, -1].argmax(-1)
        return self.exchange(grid, node, round_, protocol.SL_EVAL_NEXT, {}, {protocol.TOKENS: tokens})
