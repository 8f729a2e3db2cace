"""Membership inference with shadow models (Shokri et al., S&P 2017), and its attribute-inference variant.

The attacker queries the fine-tuned model as a black box: for a (image, question,
answer) record it reads the model's confidences on the answer (teacher-forced):
the sorted top probabilities at the first answer position, the probability of the
true first token, the mean log-likelihood of the answer tokens and the entropy —
Shokri's prediction vector, summarised so that one attack model serves every answer
(his per-class attack models would need a class per answer word).

Shadow models copy the victims' recipe (the public base, LoRA, AdamW at the run's
learning rate) on disjoint halves of the auxiliary data; the attack model
(scikit-learn's logistic regression) learns in/out from their confidences and is applied to the target's.

Attribute inference: for a record whose answer (the sensitive attribute, e.g. the
shape's colour) is unknown, every candidate answer of that question kind is scored
by the attack model, and the most "member-like" one is the guess; the trivial
attacker guesses the most common auxiliary answer of that kind.

`mia_loss` is the loss-threshold attack (Yeom et al., CSF 2018): a record's score is the
target's likelihood of its answer, no shadow models; with `reference = "public"`, that likelihood
over the public model's (difficulty calibration, Watson et al., ICLR 2022). On a run with canaries (data.canaries:
rows with random answers, each put in a client's training data by a fair coin) both attacks are
a membership audit: beside AUC and TPR at low FPR they report Steinke et al.'s one-run lower
bound on epsilon over every canary (attacks.metrics.canary_audit), and the accountant's epsilon
from the run's status.
"""

import copy
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from tqdm.auto import tqdm

from attacks.base import MEMBERSHIP, MODEL, QUERY, Attack, AttackResult, Truth, register_attack
from attacks.knowledge import AttackerKnowledge, TrainingRecipe
from attacks.metrics import canary_audit, membership_metrics
from attacks.recording import Recording
from attacks.context import ReplayContext, accounted_epsilon, final_model
from pruning import VisualTokenSelector
from training.selector import build_selector
from vlm.lora import lora_parameters
from vlm.segments import (
    merge_multimodal_inputs,
    next_token_loss,
    project_visual_features,
    run_decoder_layers,
)
from vqa import VQASample


@dataclass
class MIAOptions:
    shadows: int = 4
    # Records each shadow trains on; as many auxiliary records stay out of it.
    shadow_records: int = 256
    # None: the victims' recipe (knowledge.recipe), else FALLBACK_RECIPE.
    shadow_steps: int | None = None
    shadow_lr: float | None = None
    batch_size: int | None = None
    # Members and non-members (each) drawn from the truth's candidates.
    candidates: int = 256
    # Member records whose answer is inferred (0: no attribute inference).
    attribute_records: int = 64
    seed: int = 0
    progress: bool = True


FALLBACK_RECIPE = TrainingRecipe(lr=1e-3, batch_size=8, steps=500)


class MIA(Attack):
    name = "mia"
    threat_model = QUERY
    kind = MEMBERSHIP
    reads = (MODEL,)
    headline = ("attack_success",)
    Options = MIAOptions

    def __init__(self, knowledge: AttackerKnowledge, **options) -> None:
        super().__init__(knowledge, **options)
        self.target: torch.nn.Module | None = None
        # A run with canaries: the delta of its audit, and the budget its accountant reported.
        self.audit_delta: float | None = None
        self.accounted: dict[str, float] = {}
        # The run's pruning policy, which every model here is queried (and shadows train) through,
        # as a client's deployed model sees its inputs (None: all visual tokens).
        self.query_selector: VisualTokenSelector | None = None
        self.query_policy = "off"
        # Vision features by image id: the tower is frozen and public, the same in every model here.
        self._features: dict[str, torch.Tensor] = {}

    def set_target(self, model: torch.nn.Module) -> "MIA":
        """The fine-tuned model the attacker may query (black box: only its confidences are read)."""
        self.target = model
        return self

    # -- confidences -----------------------------------------------------------------------------
    @torch.no_grad()
    def confidences(self, model: torch.nn.Module, records: Sequence[VQASample],
                    answers: Sequence[str] | None = None) -> np.ndarray:
        """Feature rows (see the module doc) of `model` on `records` (with `answers` in place of theirs)."""
        rows = []
        for start in range(0, len(records), 64):
            batch = list(records[start : start + 64])
            batch_answers = [s.answer for s in batch] if answers is None else list(answers[start : start + 64])
            rows.append(answer_confidences(*self._logits(model, batch, batch_answers)))
        return torch.cat(rows).numpy()

    def _logits(self, model: torch.nn.Module, batch: Sequence[VQASample], answers: Sequence[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.knowledge
        missing = list({s.image_id: s for s in batch if s.image_id not in self._features}.values())
        if missing:
            self._features.update(zip([s.image_id for s in missing], k.features(k.pixel_values(missing)), strict=True))
        stacked = torch.stack([self._features[s.image_id] for s in batch]).to(k.device)
        rows = list(stacked)
        if self.query_selector is not None:
            rows = self.query_selector(stacked, list(batch)).rows(stacked)
        visual = [project_visual_features(model, r.unsqueeze(0))[0] for r in rows]
        inputs = merge_multimodal_inputs(model, [k.prompt_ids(s.question) for s in batch], visual,
                                         [k.answer_ids(a) for a in answers])
        logits = run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                                    k.num_layers, apply_head=True)
        return logits, inputs.labels

    # -- shadows ---------------------------------------------------------------------------------
    @property
    def recipe(self) -> TrainingRecipe:
        """The shadows' recipe: the options where set, else the victims', else the fallback."""
        o, known = self.options, self.knowledge.recipe or FALLBACK_RECIPE
        return TrainingRecipe(
            lr=known.lr if o.shadow_lr is None else o.shadow_lr,
            batch_size=known.batch_size if o.batch_size is None else o.batch_size,
            steps=known.steps if o.shadow_steps is None else o.shadow_steps,
        )

    def train_shadow(self, records: Sequence[VQASample], seed: int) -> torch.nn.Module:
        """The public model fine-tuned (LoRA, AdamW) on `records`, as the victims fine-tune it."""
        recipe = self.recipe
        shadow = copy.deepcopy(self.knowledge.model)
        parameters = list(lora_parameters(shadow).values())
        for parameter in parameters:
            parameter.requires_grad_(True)
        optimizer = torch.optim.AdamW(parameters, lr=recipe.lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(recipe.steps):
            batch = [records[int(i)] for i in torch.randint(len(records), (recipe.batch_size,), generator=generator)]
            logits, labels = self._logits(shadow, batch, [s.answer for s in batch])
            loss = next_token_loss(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return shadow.eval()

    def fit(self, aux: Sequence[VQASample]) -> "MIA":
        o = self.options
        aux = list(aux)
        if len(aux) < 2 * o.shadow_records:
            raise ValueError(f"MIA needs {2 * o.shadow_records} auxiliary records (shadow_records in and as many "
                             f"out), got {len(aux)}")
        generator = torch.Generator().manual_seed(o.seed)
        features, labels = [], []
        for shadow_index in tqdm(range(o.shadows), desc="MIA shadow models", disable=not o.progress):
            order = torch.randperm(len(aux), generator=generator)
            inside = [aux[int(i)] for i in order[: o.shadow_records]]
            outside = [aux[int(i)] for i in order[o.shadow_records : 2 * o.shadow_records]]
            shadow = self.train_shadow(inside, o.seed + 1 + shadow_index)
            features += [self.confidences(shadow, inside), self.confidences(shadow, outside)]
            labels += [np.ones(len(inside)), np.zeros(len(outside))]
        # A linear attack model: with a few shadows' records, a more flexible one overfits their noise.
        self.attack_model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        self.attack_model.fit(np.concatenate(features), np.concatenate(labels))
        self.answers_by_kind = answers_by_kind(aux)
        return self

    def membership_scores(self, model: torch.nn.Module, records: Sequence[VQASample],
                          answers: Sequence[str] | None = None) -> np.ndarray:
        return self.attack_model.predict_proba(self.confidences(model, records, answers))[:, 1]

    # -- the attack ------------------------------------------------------------------------------
    def infer_attributes(self, model: torch.nn.Module, records: Sequence[VQASample]) -> dict[str, float]:
        """Guess each record's answer among its question kind's answers; accuracy, the prior's
        (most common auxiliary answer of the kind) and chance (a uniform guess among the kind's answers)."""
        correct, prior_correct, chance, scored = 0, 0, 0.0, 0
        for record in records:
            counts = self.answers_by_kind.get(record.question_kind)
            if not counts or len(counts) < 2:
                continue
            options = sorted(counts)
            scores = self.membership_scores(model, [record] * len(options), options)
            correct += options[int(np.argmax(scores))] == record.answer
            prior_correct += counts.most_common(1)[0][0] == record.answer
            chance += 1 / len(options)
            scored += 1
        if not scored:
            return {}
        return {"attribute_accuracy": correct / scored, "baseline_attribute_accuracy": prior_correct / scored,
                "chance_attribute_accuracy": chance / scored, "attribute_records": float(scored)}

    def prepare_replay(self, run: ReplayContext) -> None:
        """The target: the run's fine-tuned model of client `run.partition`, queried through the
        run's pruning policy; with canaries, the audit's delta (the run's privacy.dp.delta) and
        the budget the run's status reports."""
        self.set_target(final_model(run))
        if run.config.pruning.policy != "off":
            self.query_selector = build_selector(run.config, tokenizer=self.knowledge.tokenizer, device=self.knowledge.device,
                                                 model=self.knowledge.model, instruction=self.knowledge.instruction,
                                                 pixel_values=self.knowledge.pixel_values)
            self.query_policy = run.config.pruning.policy
        if run.config.data.canaries:
            self.audit_delta = run.config.privacy.dp.delta
            self.accounted = accounted_epsilon(run)

    def run(self, recording: Recording | None, truth: Truth | None = None) -> AttackResult:
        """Query the target on the truth's members and non-members (the recording is not read:
        membership inference needs only the fine-tuned model's answers)."""
        o = self.options
        if self.target is None:
            raise ValueError("MIA queries the fine-tuned model: call set_target(model) first")
        if not hasattr(self, "attack_model"):
            raise RuntimeError("MIA.fit(aux) must run before the attack (it trains the shadow models)")
        if truth is None:
            raise ValueError("MIA needs candidates to decide on: pass a truth with membership()")
        members, non_members = truth.membership()
        generator = torch.Generator().manual_seed(o.seed)
        # As many non-members as members, so that attack success (accuracy at 0.5) has 0.5 as chance.
        count = min(len(members), len(non_members), o.candidates)
        members, non_members = (
            [records[int(i)] for i in torch.randperm(len(records), generator=generator)[:count]]
            for records in (members, non_members)
        )
        scores = self.membership_scores(self.target, [*members, *non_members])
        is_member = [True] * len(members) + [False] * len(non_members)
        # The scores themselves are kept so that ROC curves can be drawn from the saved result.
        result = AttackResult(self.name, details={"members": len(members), "non_members": len(non_members),
                                                  "queried_through": self.query_policy},
                              outputs={"scores": torch.as_tensor(scores, dtype=torch.float32),
                                       "is_member": torch.tensor(is_member)})
        result.metrics.update(membership_metrics(scores, is_member))
        if self.audit_delta is not None:
            result.metrics.update(canary_audit(lambda records: self.membership_scores(self.target, records), truth,
                                               self.audit_delta))
            result.metrics.update(self.accounted)
        if o.attribute_records:
            result.metrics.update(self.infer_attributes(self.target, members[: o.attribute_records]))
        return result



def answers_by_kind(aux: Sequence[VQASample]) -> dict[str, Counter]:
    """The public data's answers of each question kind, counted (attribute inference's candidates)."""
    kinds: dict[str, Counter] = defaultdict(Counter)
    for sample in aux:
        kinds[sample.question_kind][sample.answer] += 1
    return dict(kinds)


NO_REFERENCE, PUBLIC_REFERENCE = "none", "public"
REFERENCES = (NO_REFERENCE, PUBLIC_REFERENCE)


@dataclass
class LossOptions:
    # Members and non-members (each) drawn from the truth's candidates.
    candidates: int = 256
    # Member records whose answer is inferred (0: no attribute inference).
    attribute_records: int = 64
    # "none": the target's likelihood alone (Yeom et al.); "public": calibrated by the public
    # model's likelihood of the same record (Watson et al., ICLR 2022), the reference a fine-tune
    # on public weights hands every attacker.
    reference: str = NO_REFERENCE
    seed: int = 0
    progress: bool = True


class LossThresholdMIA(MIA):
    """Membership by the target's likelihood of the answer alone (no shadows, no attack model):
    exp of the answer tokens' mean log-likelihood, so a score of 0.5 is a geometric-mean
    token probability of one half.

    With `reference = "public"` the score is the sigmoid of the target's mean log-likelihood less
    the public model's, so 0.5 is a record the fine-tune did not change: a record the public model
    already answers (most of a generalising base's non-members) no longer passes for a member.
    """

    name = "mia_loss"
    Options = LossOptions

    def fit(self, aux: Sequence[VQASample]) -> "LossThresholdMIA":
        if self.options.reference not in REFERENCES:
            raise ValueError(f"reference={self.options.reference!r}; allowed: {REFERENCES}")
        self.answers_by_kind = answers_by_kind(aux)
        self.attack_model = None
        return self

    def membership_scores(self, model: torch.nn.Module, records: Sequence[VQASample],
                          answers: Sequence[str] | None = None) -> np.ndarray:
        likelihood = self.confidences(model, records, answers)[:, MEAN_LOG_LIKELIHOOD]
        if self.options.reference == NO_REFERENCE:
            return np.exp(likelihood)
        public = self.confidences(self.knowledge.model, records, answers)[:, MEAN_LOG_LIKELIHOOD]
        return 1.0 / (1.0 + np.exp(public - likelihood))


# The column of the answer's mean log-likelihood in MIA.confidences' rows.
MEAN_LOG_LIKELIHOOD = 4


def answer_confidences(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """MIA.confidences' rows from teacher-forced `logits` and their `labels` (-100 off the answer):
    the top-3 probabilities and the true token's at the first answer position, the answer's mean
    log-likelihood and the first position's entropy. In float64: a record fine-tuned to a loss below
    float32's resolution near 1 (about 6e-8) would otherwise score exactly 1, tied with every other
    such record, and a memorised member could not be told from a non-member the base answers well."""
    log_probs = logits[:, :-1].double().log_softmax(-1)
    targets = labels[:, 1:]
    labelled = targets != -100
    token_log_probs = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    rows = torch.arange(len(logits))
    first = labelled.double().argmax(-1)
    first_dist = log_probs[rows, first].exp()
    top = first_dist.sort(-1, descending=True).values[:, :3]
    entropy = -(first_dist * first_dist.clamp(min=1e-12).log()).sum(-1)
    p_true = token_log_probs[rows, first].exp()
    mean_log_likelihood = (token_log_probs * labelled).sum(-1) / labelled.sum(-1)
    return torch.cat([top, p_true[:, None], mean_log_likelihood[:, None], entropy[:, None]], -1)

register_attack(MIA)
register_attack(LossThresholdMIA)
