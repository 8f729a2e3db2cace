"""Membership audit of a released task vector (DP-MTV, paradigm mtv): canary demonstrations in or out of its chunks.

Whoever holds the release (values and head mask: post-processing, so anyone the vector is
shared with) and the public model can query the model with it. The canaries (data.canaries) are
training rows with a random plausible answer; the members are those a client placed as a
demonstration in one of its chunks (attacks.truth.RunTruth.membership), the non-members canaries
no client held. A record's score is how much the vector raises the log-likelihood of the record's
own (random) answer to its own question over the zero-shot model: a vector that carries a
demonstration makes that demonstration's answer likelier.

Reports AUC, TPR at low FPR and the one-run audit's epsilon lower bound over every canary, held
(shown or not: the release is a function of what a client holds) or left out by its coin
(attacks.metrics.canary_audit), at the release's δ, beside the ledger's ε.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attacks.base import MEMBERSHIP, QUERY, TASK_VECTOR, Attack, AttackResult, Truth, register_attack
from attacks.context import ReplayContext
from attacks.metrics import canary_audit, membership_metrics
from attacks.recording import Recording
from training.protocol import TASK_VECTOR_FILE
from vlm.features import VisionFeatureCache
from vlm.task_vectors import FirstAnswerToken, head_layout, replaced_heads
from vqa import VQASample

@dataclass
class TaskVectorMIAOptions:
    # Members and non-members (each) drawn from the truth's candidates.
    candidates: int = 256
    seed: int = 0
    progress: bool = True


class TaskVectorMIA(Attack):
    name = "mtv_mia"
    threat_model = QUERY
    kind = MEMBERSHIP
    reads = (TASK_VECTOR,)
    headline = ("auc",)
    Options = TaskVectorMIAOptions

    def __init__(self, knowledge, **options) -> None:
        super().__init__(knowledge, **options)
        self.release: dict | None = None
        self.audit_delta: float | None = None
        self.accounted: dict[str, float] = {}

    def prepare_replay(self, run: ReplayContext) -> None:
        """The run's released task vector, the release's δ, and the ε its ledger reports."""
        path = run.folder / TASK_VECTOR_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: mtv_mia audits the task vector a paradigm=mtv run released")
        self.release = torch.load(path, weights_only=True)
        self.audit_delta = run.config.privacy.mtv.delta
        epsilon = self.release["ledger"]["epsilon"]
        self.accounted = {"accountant_epsilon": epsilon} if np.isfinite(epsilon) else {}

    def fit(self, aux: Sequence[VQASample]) -> "TaskVectorMIA":
        return self  # nothing to learn: the score is the vector's own lift

    @torch.no_grad()
    def lift(self, records: Sequence[VQASample]) -> np.ndarray:
        """Per record: log p(its answer's first token | its question, with the vector) − the same zero-shot."""
        model, release = self.knowledge.model, self.release
        layout = head_layout(model, release["layers"])
        features = VisionFeatureCache(model, self.knowledge.preprocess_images)
        features.add(records, progress=self.options.progress)
        answers = FirstAnswerToken(model, self.knowledge.tokenizer, features, records,
                                   instruction=self.knowledge.instruction)
        zero_shot = answers.log_likelihood()
        with replaced_heads(model, layout, release["values"].float(), release["mask"].bool()):
            replaced = answers.log_likelihood()
        return (replaced - zero_shot).cpu().numpy()

    def run(self, recording: Recording | None, truth: Truth | None = None) -> AttackResult:
        """Score the truth's members and non-members (the recording is not read: the release is public)."""
        if self.release is None:
            raise ValueError("mtv_mia audits a released task vector: replay it on a paradigm=mtv run folder")
        if truth is None:
            raise ValueError("mtv_mia needs candidates to decide on: pass a truth with membership()")
        members, non_members = truth.membership()
        generator = torch.Generator().manual_seed(self.options.seed)
        count = min(len(members), len(non_members), self.options.candidates)
        if count < 2:
            raise ValueError(f"{len(members)} canaries were demonstrations and {len(non_members)} never held: the audit "
                             "needs at least 2 of each (raise data.canaries)")
        members, non_members = (
            [records[int(i)] for i in torch.randperm(len(records), generator=generator)[:count]]
            for records in (members, non_members)
        )
        scores = self.lift([*members, *non_members])
        is_member = [True] * count + [False] * count
        # A score of the 0.5 decision: the vector made the answer likelier at all.
        probabilities = 1 / (1 + np.exp(-scores))
        result = AttackResult(self.name, details={"members": count, "non_members": count,
                                                  "selected_heads": int(self.release["mask"].sum())},
                              outputs={"scores": torch.as_tensor(scores, dtype=torch.float32),
                                       "is_member": torch.tensor(is_member)})
        result.metrics.update(membership_metrics(probabilities, is_member))
        result.metrics.update(canary_audit(self.lift, truth, self.audit_delta))
        result.metrics.update(self.accounted)
        result.metrics["mean_lift_members"] = float(scores[:count].mean())
        result.metrics["mean_lift_non_members"] = float(scores[count:].mean())
        return result


register_attack(TaskVectorMIA)
