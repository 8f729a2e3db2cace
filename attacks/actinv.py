"""ActInv (SPEC.md §2): recover the prompt text from the activations at the first cut.

The white-box server knows the public front F_C (decoder layers [0, C) of the public
checkpoint). For each sample it starts from L random rows of the embedding matrix E,
minimises the cosine distance between F_C(ĥ0) and the observed rows with Adam (lr
0.01, 2000 iterations by default), and maps each optimised row to its nearest token
embedding. The visual rows (after the template's prefix) have no token to map to;
the text is every other position, and the question is what follows the visual rows.

Two changes for a multimodal prompt, measured on the mini model (CA=2, 8 samples,
1,000 iterations: question-token recall 0.32 for the joint attack — 0.43 at 2,000 —
and 0.70 with both):
the prompt is solved run by run (prefix text, visual rows, the rest — causal
attention makes each run depend only on what precedes it), visual rows start from the
mean projected visual token; and each text position is chosen left to right among its
nearest tokens by how well its own row matches (`refine_candidates`; 0 keeps the
paper's plain projection).

Adaptive against sparsification and PriPert-L0 (`mask_zeros`; the attacker knows the
defense zeroes elements): the cosine distance of each row is taken only over the
elements where the observed row is non-zero — both vectors restricted to that
support — so the optimised inputs are not pulled towards zeros the client never
computed (the paper's masked-distance adaptive attacker). The refinement's scoring
uses the same distance. A row the defense zeroed entirely says nothing and scores 0.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from attacks.base import ACTIVATION, PASSIVE, TEXT, Attack, AttackResult, Truth, register_attack
from attacks.knowledge import split_packed
from attacks.metrics import text_metrics
from attacks.observations import VisualSpans, fewer_visual_rows
from attacks.recording import Recording
from training import protocol
from vlm.segments import (
    llava_parts,
    project_visual_features,
    run_decoder_layers,
)
from vqa import VQASample

NEAREST = ("l2", "cosine")


@dataclass
class ActInvOptions:
    iterations: int = 2000
    lr: float = 0.01
    # How an optimised row is mapped to a token: nearest by Euclidean distance or by cosine.
    nearest: str = "l2"
    # Instead of the plain projection, pick each text position left to right among this many
    # nearest tokens to its optimised row, by how well its own row matches (0: the paper's
    # projection only; at least the vocabulary size: an exhaustive choice).
    refine_candidates: int = 64
    # Stored transfers to attack (0: all); each costs `iterations` forward/backward passes.
    max_transfers: int = 0
    # The cosine distance over each observed row's non-zero elements only (adaptive against
    # defenses that zero elements: sparsification, PriPert-L0).
    mask_zeros: bool = False
    seed: int = 0
    progress: bool = True


class ActInv(Attack):
    name = "actinv"
    threat_model = PASSIVE
    kind = TEXT
    reads = (ACTIVATION,)
    headline = ("token_recall",)
    Options = ActInvOptions

    def fit(self, aux: Sequence[VQASample]) -> "ActInv":
        """The mean projected visual token of auxiliary images (where visual rows start); keeps
        `aux` to locate pruned visual rows."""
        k, o = self.knowledge, self.options
        if o.nearest not in NEAREST:
            raise ValueError(f"nearest={o.nearest!r}; allowed: {NEAREST}")
        self.aux = list(aux)
        # Special tokens never occur in the text, bar the answer's end: the image placeholder is
        # replaced by visual rows, and padding, BOS and UNK are not in a prompt the clients build.
        tokenizer = k.tokenizer
        self.banned = sorted({*tokenizer.all_special_ids, k.config.image_token_id} - {tokenizer.eos_token_id})
        with torch.no_grad():
            features = k.features(k.pixel_values(self.aux[:64])).to(k.device)
            self.visual_mean = project_visual_features(k.model, features).float().mean((0, 1)).cpu()
        return self

    def distance(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per row (last dimension), 1 − cosine of `out` and the observed `target`; with `mask_zeros`
        over the elements where `target` is non-zero only."""
        if not self.options.mask_zeros:
            return 1 - F.cosine_similarity(out, target, dim=-1)
        return masked_cosine_distance(out, target)

    def invert(self, rows: torch.Tensor, lengths: torch.Tensor, visual: Sequence[int]) -> list[torch.Tensor]:
        """Token ids at every position of each sample of one packed activation, whose sample b
        holds `visual[b]` visual rows after the template's prefix.

        Run by run: row i depends only on inputs 0..i (causal attention), so the prefix, the
        visual rows and the rest are each solved against their own rows with everything before
        already fixed. Solving all at once lets the badly fitting visual rows' gradients swamp
        the text before them. Samples with the same number of visual rows solve together, the
        shorter ones padded on the right (which, being later, no real row attends to).
        """
        if not hasattr(self, "visual_mean"):
            raise RuntimeError("ActInv.fit(aux) must run before the attack")
        samples = split_packed(rows.float(), lengths)
        ids: list[torch.Tensor | None] = [None] * len(samples)
        for count in sorted(set(visual)):
            members = [b for b, c in enumerate(visual) if c == count]
            for b, found in zip(members, self._invert_group([samples[b] for b in members], count), strict=True):
                ids[b] = found
        return ids  # type: ignore[return-value]

    def _invert_group(self, targets: Sequence[torch.Tensor], visual: int) -> list[torch.Tensor]:
        k, o = self.knowledge, self.options
        embedding = llava_parts(k.model).language_model.embed_tokens.weight.detach()
        prefix = k.prefix_ids.numel()
        lengths = torch.tensor([t.shape[0] for t in targets])
        longest = int(lengths.max())
        target = torch.stack([F.pad(t, (0, 0, 0, longest - t.shape[0])) for t in targets])
        real = torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)
        inputs = torch.zeros(len(targets), longest, k.hidden_size)
        ids = torch.zeros(len(targets), longest, dtype=torch.long)
        generator = torch.Generator().manual_seed(o.seed)
        runs = [(range(prefix), True), (range(prefix, prefix + visual), False),
                (range(prefix + visual, longest), True)]
        for run, is_text in (r for r in runs if len(r[0])):
            if is_text:
                start = embedding[torch.randint(embedding.shape[0], (len(targets), len(run)), generator=generator)]
            else:
                # Visual rows start from the mean projected visual token: they are no word.
                start = self.visual_mean.expand(len(targets), len(run), -1)
            guess = start.clone().requires_grad_()
            optimizer = torch.optim.Adam([guess], lr=o.lr)
            for _ in range(o.iterations):
                out = self._front(torch.cat([inputs[:, : run.start], guess], dim=1))[:, run.start :]
                loss = self.distance(out, target[:, run])[real[:, run]].mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            inputs[:, run] = guess.detach()
            if is_text:
                for b, length in enumerate(lengths.tolist()):
                    span = range(run.start, min(run.stop, length))
                    if len(span):
                        ids[b, span] = self._project(inputs[b, :length], target[b, :length], span, embedding)
                        inputs[b, span] = embedding[ids[b, span]]
        return [ids[b, :length] for b, length in enumerate(lengths.tolist())]

    def _front(self, inputs: torch.Tensor) -> torch.Tensor:
        batch, length = inputs.shape[:2]
        mask = torch.ones(batch, length, dtype=torch.long)
        positions = torch.arange(length).unsqueeze(0).expand(batch, -1)
        return run_decoder_layers(self.knowledge.model, inputs, mask, positions, 0, self.knowledge.first_cut)

    @torch.no_grad()
    def _project(self, inputs: torch.Tensor, target: torch.Tensor, run: range, embedding: torch.Tensor
                 ) -> torch.Tensor:
        """A text run's tokens, left to right: among each position's nearest tokens to the optimised
        row, the one whose own row best matches given the tokens already chosen (the joint
        optimum of a run's continuous inputs projects to neighbouring, wrong tokens)."""
        o = self.options
        ranked = self.ranked_tokens(inputs[run].unsqueeze(0), embedding)[0]
        ids = ranked[:, 0].clone()
        if not o.refine_candidates:
            return ids
        current = inputs.clone()
        # Banned tokens rank last: never candidates.
        candidates = ranked[:, : min(o.refine_candidates, embedding.shape[0] - len(self.banned))]
        for slot, position in enumerate(run):
            trial = current[: position + 1].unsqueeze(0).repeat(candidates.shape[1], 1, 1)
            trial[:, position] = embedding[candidates[slot]]
            out = self._front(trial)[:, position]
            ids[slot] = candidates[slot, int(self.distance(out, target[position].unsqueeze(0)).argmin())]
            current[position] = embedding[ids[slot]]
        return ids

    def ranked_tokens(self, rows: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Token ids by nearness to each row ([..., V], nearest first; banned tokens last)."""
        if self.options.nearest == "cosine":
            score = F.normalize(rows, dim=-1) @ F.normalize(embedding, dim=-1).T
        else:
            score = -torch.cdist(rows, embedding.unsqueeze(0).expand(rows.shape[0], -1, -1))
        score[..., self.banned] = -torch.inf
        return score.argsort(-1, descending=True)

    def nearest_tokens(self, rows: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return self.ranked_tokens(rows, embedding)[..., 0]

    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        k, o = self.knowledge, self.options
        kind = recording.first_cut_kind(attack=self.name)
        entries = recording.require(kind, attack=self.name)
        entries = entries[: o.max_transfers] if o.max_transfers else entries
        spans = VisualSpans(k, k.first_cut).fit(self.aux) if fewer_visual_rows(recording.config) else None
        prefix = k.prefix_ids.numel()
        recovered, questions, true_text, true_questions = [], [], [], []
        for entry in tqdm(entries, desc="ActInv transfers", disable=not o.progress):
            tensors = recording.tensors(entry)
            samples = truth.samples(entry) if truth is not None else None
            sample_rows = split_packed(tensors[protocol.ROWS], tensors[protocol.LENGTHS])
            visual = [k.num_patches if spans is None else spans.count(rows) for rows in sample_rows]
            inverted = self.invert(tensors[protocol.ROWS], tensors[protocol.LENGTHS], visual)
            for index, (ids, count) in enumerate(zip(inverted, visual, strict=True)):
                recovered.append(torch.cat([ids[:prefix], ids[prefix + count :]]).tolist())
                # The question follows the visual rows; its length is the attacker's to guess, so
                # its span is scored by position against the truth's.
                questions.append(ids[prefix + count :].tolist())
                if samples is not None:
                    sample = samples[index]
                    prompt = k.prompt_ids(sample.question)
                    answer = k.answer_ids(sample.answer)
                    true_text.append(torch.cat([prompt[:prefix], prompt[prefix + 1 :], answer]).tolist())
                    true_questions.append(_question_ids(k, sample.question))
        result = AttackResult(self.name, details={"samples": len(recovered),
                                                  "recovered_text": [k.tokenizer.decode(t) for t in recovered[:20]]})
        if true_questions and len(true_questions) == len(questions):
            spans_q = [q[: len(t)] for q, t in zip(questions, true_questions, strict=True)]
            result.metrics.update(text_metrics(spans_q, true_questions))
            whole = text_metrics(recovered, true_text)
            result.metrics.update({f"whole_prompt_{name}": value for name, value in whole.items()})
            result.details["true_questions"] = [k.tokenizer.decode(t) for t in true_questions[:20]]
        return result


def masked_cosine_distance(out: torch.Tensor, target: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """1 − cos(out|S, target|S) per row, S the elements where `target` is non-zero (broadcasting as
    `F.cosine_similarity` does); 0 for a row whose target is all zeros (nothing observed)."""
    support = (target != 0).to(out.dtype)
    out_on, target_on = out * support, target * support
    dot = (out_on * target_on).sum(-1)
    norms = out_on.norm(dim=-1).clamp_min(eps) * target_on.norm(dim=-1).clamp_min(eps)
    observed = support.sum(-1) > 0
    return torch.where(observed, 1 - dot / norms, torch.zeros_like(dot))


def _question_ids(knowledge, question: str) -> list[int]:
    """The question's tokens as they sit in the prompt (the template's text after the image)."""
    prompt = knowledge.prompt_ids(question)
    template = knowledge.prompt_ids("")
    prefix = knowledge.prefix_ids.numel()
    suffix = template.numel() - prefix - 1
    return prompt[prefix + 1 : prompt.numel() - suffix].tolist()


register_attack(ActInv)
