"""iDLG (Zhao et al., 2020): recover the labels behind a gradient, analytically, then by matching.

The labels here are the answer tokens, which USL keeps on the client (its loss is
computed in the private tail). Two observations carry them to the server:

- USL's gradient at CB. The server knows the rows it sent to the tail (h) and
  receives g = ∂L/∂h. With the public tail, the loss is a sum over labelled
  positions of logsumexp(logits_t) − logits_t[y], so g is *linear* in the one-hot
  labels. iDLG's insight — the label shows in the gradient's structure — becomes a
  peel from the sequence's end: the last labelled position's row of g is
  s·J_tᵀ(p_t − e_y) alone (nothing after it attends back), which names y and the
  loss normaliser s; its full contribution is then subtracted and the next position
  read the same way, until "no label" explains a row better than any token.
  `matching` is DLG's way for comparison: soft labels from noise, optimised until
  their gradient's cosine with g is maximal.
- FL's adapter update. The update of the last decoder layer's o_proj / down_proj
  LoRA-B is a sum of outer products whose left factors are the gradients at the
  model's output, ≈ γ ⊙ W_y (final-norm weight times the label's LM-head row) per
  labelled token. Tokens are ranked by how much of γ ⊙ W_c lies in the column space
  of the update (an analytic rule in iDLG's spirit; exact ranks need T_l = 1).

The public tail equals the client's private tail only while its LoRA is untrained;
later the peel is an approximation, which the residual it leaves shows.
"""

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import get_peft_model_state_dict
from torch.nn import functional as F
from tqdm.auto import tqdm

from attacks.base import GRADIENT, LABEL, PASSIVE, UPDATE, Attack, AttackResult, Truth, register_attack
from attacks.knowledge import split_packed
from attacks.metrics import label_accuracy, token_precision_recall
from attacks.recording import MissingObservationError, Recording
from training import protocol
from vlm.lora import decoder_layer_index
from vlm.paradigms import PARADIGMS
from vlm.segments import llava_parts, run_decoder_layers
from vqa import VQASample

# The LoRA-B matrices whose outputs feed the residual stream directly before the final norm.
OUTPUT_MODULES = ("self_attn.o_proj", "mlp.down_proj")


@dataclass
class IDLGOptions:
    # Also run DLG's gradient matching from noise on the cut gradients (for comparison).
    matching: bool = True
    matching_iterations: int = 300
    matching_lr: float = 0.1
    # Labelled positions the peel reads at most (answers are short; a gradient without labels
    # would otherwise be peeled to the first position).
    max_labels: int = 16
    # Singular values of the FL update above this share of the largest span its label space.
    rank_tolerance: float = 0.1
    seed: int = 0
    progress: bool = True


class IDLG(Attack):
    name = "idlg"
    threat_model = PASSIVE
    kind = LABEL
    # USL's gradient at CB scores each sample's answer (label_accuracy); an FL update, the
    # answer tokens of the update's whole batch (label_precision).
    reads = (GRADIENT, UPDATE)
    headline = ("label_accuracy", "label_precision")
    Options = IDLGOptions

    def fit(self, aux: Sequence[VQASample]) -> "IDLG":
        """Nothing to train (the attack is analytic given the public model); the most common
        auxiliary answer is the trivial attacker's guess, the baseline."""
        answers = Counter(sample.answer for sample in aux)
        self.prior_answer = answers.most_common(1)[0][0] if answers else None
        # Gradient matching differentiates a gradient: fused attention kernels have no second
        # derivative, so the attacker's copy computes attention explicitly.
        self.model = copy.deepcopy(self.knowledge.model)
        llava_parts(self.model).language_model.set_attn_implementation("eager")
        return self

    # -- USL: the gradient at CB ---------------------------------------------------------------
    def _tail(self, rows: torch.Tensor) -> torch.Tensor:
        k = self.knowledge
        if not hasattr(self, "model"):
            raise RuntimeError("IDLG.fit(aux) must run before the attack")
        if len(k.cuts) != 2:
            raise ValueError(f"cut-layer iDLG reads USL's gradient at CB; this run's cuts are {k.cuts}")
        length = rows.shape[0]
        mask = torch.ones(1, length, dtype=torch.long)
        positions = torch.arange(length).unsqueeze(0)
        return run_decoder_layers(self.model, rows.unsqueeze(0), mask, positions, k.cuts[1], k.num_layers,
                                  apply_head=True)[0]

    def labels_from_cut_gradient(self, rows: torch.Tensor, grad: torch.Tensor) -> tuple[list[int], float]:
        """One sample's label tokens (in order, each the token after its position) and the
        fitted loss normaliser s = 1/(labelled tokens in the batch)."""
        h = rows.float().detach().requires_grad_()
        g = grad.float()
        logits = self._tail(h)
        vocab = logits.shape[-1]
        residual = g.clone()
        scale = None
        labels: list[int] = []
        for t in range(h.shape[0] - 2, max(-1, h.shape[0] - 2 - self.options.max_labels), -1):
            # Rows of ∂logits_t[c]/∂h at position t, for every token c.
            eye = torch.eye(vocab).unsqueeze(1).expand(vocab, h.shape[0], vocab).clone()
            eye[:, torch.arange(h.shape[0]) != t] = 0
            jacobian = torch.autograd.grad(logits, h, eye, retain_graph=True, is_grads_batched=True)[0][:, t]
            probabilities = logits[t].detach().softmax(-1)
            candidates = probabilities @ jacobian - jacobian  # [V, D]: ∂(lse_t − logits_t[c])/∂h_t
            r = residual[t]
            if scale is None:
                fitted = (candidates @ r) / candidates.pow(2).sum(-1).clamp(min=1e-30)
                errors = (r - fitted.unsqueeze(-1) * candidates).pow(2).sum(-1)
                errors[fitted <= 0] = torch.inf
                best = int(errors.argmin())
                scale = float(fitted[best])
            else:
                errors = (r - scale * candidates).pow(2).sum(-1)
                best = int(errors.argmin())
                if r.pow(2).sum() <= errors[best]:
                    break
            labels.append(best)
            term = torch.logsumexp(logits[t], -1) - logits[t, best]
            residual -= scale * torch.autograd.grad(term, h, retain_graph=True)[0]
        return labels[::-1], scale if scale is not None else 0.0

    def labels_by_matching(self, rows: torch.Tensor, grad: torch.Tensor, count: int) -> list[int]:
        """DLG: soft labels for the last `count` labelled positions, from noise, matched by cosine."""
        o = self.options
        h = rows.float().detach().requires_grad_()
        logits = self._tail(h)
        positions = torch.arange(h.shape[0] - 1 - count, h.shape[0] - 1)
        generator = torch.Generator().manual_seed(o.seed)
        soft = torch.randn(count, logits.shape[-1], generator=generator).requires_grad_()
        optimizer = torch.optim.Adam([soft], lr=o.matching_lr)
        target = grad.float().flatten()
        for _ in range(o.matching_iterations):
            loss = (torch.logsumexp(logits[positions], -1) - (soft.softmax(-1) * logits[positions]).sum(-1)).sum()
            dummy = torch.autograd.grad(loss, h, create_graph=True)[0].flatten()
            distance = 1 - F.cosine_similarity(dummy, target, dim=0)
            optimizer.zero_grad(set_to_none=True)
            distance.backward(retain_graph=True)
            optimizer.step()
        return soft.argmax(-1).tolist()

    # -- FL: the adapter update ----------------------------------------------------------------
    def label_scores_from_update(self, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
                                 ) -> tuple[torch.Tensor, int]:
        """A score per token (how much of γ ⊙ W_c lies in the update's label space) and that space's rank."""
        k = self.knowledge
        last = k.num_layers - 1
        blocks = []
        for key in sorted(after):
            if "lora_B" in key and decoder_layer_index(key) == last and any(m in key for m in OUTPUT_MODULES):
                if key not in before:
                    raise MissingObservationError(f"the adapters before the update lack {key!r}")
                blocks.append((before[key] - after[key]).float())
        if not blocks:
            raise MissingObservationError(
                f"the update holds no LoRA-B of layer {last}'s {OUTPUT_MODULES}: FL iDLG reads the last layer's "
                "output adapters"
            )
        update = torch.cat(blocks, dim=1)
        basis, singular, _ = torch.linalg.svd(update, full_matrices=False)
        rank = int((singular > self.options.rank_tolerance * singular[0]).sum())
        parts = llava_parts(self.model)
        directions = parts.lm_head.weight.detach().float() * parts.language_model.norm.weight.detach().float()
        directions = F.normalize(directions, dim=-1)
        return (directions @ basis[:, :rank]).pow(2).sum(-1), rank

    # -- the attack on a recording ----------------------------------------------------------------
    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        paradigm = recording.config.get("paradigm")
        if (paradigm in PARADIGMS and PARADIGMS.get(paradigm).server_computes_loss
                or recording.select(protocol.ACTIVATION_AT_C.name)):
            raise MissingObservationError(
                "iDLG recovers labels the server does not have; in SL the answers reach the server in clear "
                "(its loss is server-side), so there is nothing to recover: use a USL or FL recording"
            )
        if recording.select(protocol.ADAPTER_UPDATE.name):
            return self._run_fl(recording, truth)
        return self._run_cut(recording, truth)

    def _run_cut(self, recording: Recording, truth: Truth | None) -> AttackResult:
        k, o = self.knowledge, self.options
        grads = recording.require(protocol.GRADIENT_AT_CB.name, attack=self.name)
        recovered, matched, original = [], [], []
        for entry in tqdm(grads, desc="iDLG", disable=not o.progress):
            sent = recording.partner(entry, protocol.ACTIVATION_AT_CB.name, "down")
            first = recording.partner(entry, protocol.ACTIVATION_AT_CA.name)
            if sent is None or first is None:
                raise MissingObservationError(
                    f"iDLG on the gradient at CB (transfer {entry.seq}) needs the rows the server sent to the tail "
                    f"({protocol.ACTIVATION_AT_CB.name!r}, direction 'down', recorded by the strategy with "
                    f"Recorder.record(..., direction='down')) and the same step's {protocol.ACTIVATION_AT_CA.name!r} "
                    "(for the samples' lengths)"
                )
            lengths = recording.tensors(first)[protocol.LENGTHS]
            rows = split_packed(recording.tensors(sent)[protocol.ROWS], lengths)
            gradients = split_packed(recording.tensors(entry)[protocol.GRAD], lengths)
            samples = truth.samples(entry) if truth is not None else None
            for index, (h, g) in enumerate(zip(rows, gradients, strict=True)):
                labels, _ = self.labels_from_cut_gradient(h, g)
                recovered.append(labels)
                if o.matching:
                    matched.append(self.labels_by_matching(h, g, max(1, len(labels))))
                if samples is not None:
                    original.append(k.answer_ids(samples[index].answer).tolist())
        result = AttackResult(self.name, details={"samples": len(recovered), "observation": protocol.GRADIENT_AT_CB.name,
                                                  "recovered": [k.tokenizer.decode(r) for r in recovered[:20]]})
        if original:
            result.metrics.update(label_accuracy(recovered, original))
            if matched:
                dlg = label_accuracy(matched, original)
                result.metrics.update({f"matching_{name}": value for name, value in dlg.items()})
            if getattr(self, "prior_answer", None) is not None:
                prior = k.answer_ids(self.prior_answer).tolist()
                baseline = label_accuracy([prior] * len(original), original)
                result.metrics["baseline_label_accuracy"] = baseline["label_accuracy"]
        return result

    def _run_fl(self, recording: Recording, truth: Truth | None) -> AttackResult:
        k, o = self.knowledge, self.options
        initial = {n: p.detach() for n, p in _adapter_state(k.model).items()}
        precision, recall, top1, ranks, count = [], [], [], [], 0
        eos = k.tokenizer.eos_token_id
        for entry in tqdm(recording.require(protocol.ADAPTER_UPDATE.name, attack=self.name), desc="iDLG", disable=not o.progress):
            sent = recording.partner(entry, protocol.GLOBAL_ADAPTERS.name, "down")
            if sent is not None:
                before = recording.tensors(sent)
            elif entry.round == 1:
                before = initial  # the seeded adapters the server itself handed out
            else:
                raise MissingObservationError(
                    f"iDLG on the FL update of round {entry.round} needs the global adapters the server sent that "
                    f"round ({protocol.GLOBAL_ADAPTERS.name!r}, direction 'down'); only round 1's are known without them"
                )
            scores, rank = self.label_scores_from_update(before, recording.tensors(entry))
            scores[eos] = -1  # every answer ends in EOS: it carries no information
            ranks.append(rank)
            count += 1
            samples = truth.samples(entry) if truth is not None else None
            if samples is None:
                continue
            labels = sorted({t for s in samples for t in k.answer_ids(s.answer).tolist() if t != eos})
            guess = scores.topk(len(labels)).indices.tolist()
            p, r = token_precision_recall(guess, labels)
            precision.append(p)
            recall.append(r)
            top1.append(float(guess[0] in labels))
        result = AttackResult(self.name, details={"updates": count, "observation": protocol.ADAPTER_UPDATE.name,
                                                  "label_space_ranks": ranks[:50]})
        if precision:
            result.metrics.update({
                "label_precision": sum(precision) / len(precision),
                "label_recall": sum(recall) / len(recall),
                "top1_label_accuracy": sum(top1) / len(top1),
            })
        return result


def _adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's adapters under peft's adapter-file keys (what FL clients send)."""
    return get_peft_model_state_dict(model)


register_attack(IDLG)
