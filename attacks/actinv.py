"""ActInv (SPEC.md §2): recover the prompt text from the activations at the first cut.

The white-box server knows the public front F_C (decoder layers [0, C) of the public
checkpoint). For each sample it starts from L random rows of the embedding matrix E,
minimises the cosine distance between F_C(ĥ0) and the observed rows with Adam (lr
0.01, 2000 iterations by default), and maps each optimised row to its nearest token
embedding. The visual rows (after the template's prefix) have no token to map to;
the text is every other position, and the question is what follows the visual rows.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from attacks.base import Attack, AttackResult, Truth, register_attack
from attacks.knowledge import split_packed
from attacks.metrics import text_metrics
from attacks.observations import VisualSpans, pruned
from attacks.recording import Recording
from vlm.segments import llava_parts, run_decoder_layers
from vqa import VQASample
from wire import unpack_rows

NEAREST = ("l2", "cosine")


@dataclass
class ActInvOptions:
    iterations: int = 2000
    lr: float = 0.01
    # How an optimised row is mapped to a token: nearest by Euclidean distance or by cosine.
    nearest: str = "l2"
    # Stored transfers to attack (0: all); each costs `iterations` forward/backward passes.
    max_transfers: int = 0
    seed: int = 0
    progress: bool = True


class ActInv(Attack):
    name = "actinv"
    threat_model = "passive"
    Options = ActInvOptions

    def fit(self, aux: Sequence[VQASample]) -> "ActInv":
        """Nothing to train (the attack optimises per observation); keeps `aux` to locate pruned visual rows."""
        if self.options.nearest not in NEAREST:
            raise ValueError(f"nearest={self.options.nearest!r}; allowed: {NEAREST}")
        self.aux = list(aux)
        return self

    def invert(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Token ids at every position of each sample of one packed activation."""
        k, o = self.knowledge, self.options
        embedding = llava_parts(k.model).language_model.embed_tokens.weight.detach()
        target, mask, positions = unpack_rows(rows.float(), lengths)
        real = mask.bool()
        generator = torch.Generator().manual_seed(o.seed)
        start = embedding[torch.randint(embedding.shape[0], real.shape, generator=generator)]
        guess = start.clone().requires_grad_()
        optimizer = torch.optim.Adam([guess], lr=o.lr)
        for _ in tqdm(range(o.iterations), desc="ActInv", disable=not o.progress, leave=False):
            out = run_decoder_layers(k.model, guess, mask, positions, 0, k.first_cut)
            loss = (1 - F.cosine_similarity(out[real], target[real], dim=-1)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return [ids[m] for ids, m in zip(self.nearest_tokens(guess.detach(), embedding), real, strict=True)]

    def nearest_tokens(self, rows: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        # The image placeholder never occurs as text: it is replaced by the visual tokens.
        banned = self.knowledge.config.image_token_id
        if self.options.nearest == "cosine":
            score = F.normalize(rows, dim=-1) @ F.normalize(embedding, dim=-1).T
        else:
            score = -torch.cdist(rows, embedding.unsqueeze(0).expand(rows.shape[0], -1, -1))
        score[..., banned] = -torch.inf
        return score.argmax(-1)

    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        k, o = self.knowledge, self.options
        kind = recording.first_cut_kind(attack=self.name)
        entries = recording.require(kind, attack=self.name)
        entries = entries[: o.max_transfers] if o.max_transfers else entries
        spans = VisualSpans(k, k.first_cut).fit(self.aux) if pruned(recording) else None
        prefix = k.prefix_ids.numel()
        recovered, questions, true_text, true_questions = [], [], [], []
        for entry in tqdm(entries, desc="ActInv transfers", disable=not o.progress):
            tensors = recording.tensors(entry)
            samples = truth.samples(entry) if truth is not None else None
            for index, (ids, rows) in enumerate(zip(self.invert(tensors["rows"], tensors["lengths"]),
                                                    split_packed(tensors["rows"], tensors["lengths"]), strict=True)):
                visual = k.num_patches if spans is None else spans.count(rows)
                text = torch.cat([ids[:prefix], ids[prefix + visual :]])
                recovered.append(text.tolist())
                # The question follows the visual rows; its length is the attacker's to guess, so
                # its span is scored by position against the truth's.
                questions.append(ids[prefix + visual :].tolist())
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


def _question_ids(knowledge, question: str) -> list[int]:
    """The question's tokens as they sit in the prompt (the template's text after the image)."""
    prompt = knowledge.prompt_ids(question)
    template = knowledge.prompt_ids("")
    prefix = knowledge.prefix_ids.numel()
    suffix = template.numel() - prefix - 1
    return prompt[prefix + 1 : prompt.numel() - suffix].tolist()


register_attack(ActInv)
