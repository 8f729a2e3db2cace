"""VQA scoring: the metrics the paper reports, defined exactly.

Every comparison runs on ``normalize_answer`` output (lower-case, punctuation and
articles removed, number words as digits), so "Two." and "2" are the same answer.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vqa.answers import normalize_answer
from vqa.schema import VQASample

# VQA accuracy: an answer given by this many humans counts as fully correct.
_HUMANS_FOR_FULL_CREDIT = 3


def exact_match(prediction: str, gold: str) -> float:
    """Closed-set accuracy: 1.0 when the normalised strings are equal."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_recall(prediction: str, gold: str) -> float:
    """Open-ended accuracy as in LLaVA-Med: share of the gold answer's tokens in the prediction.

    Tokens are counted as a multiset (a gold token repeated twice needs two
    occurrences). A gold answer with no tokens after normalisation (e.g. "the")
    falls back to exact match.
    """
    gold_tokens = Counter(normalize_answer(gold).split())
    if not gold_tokens:
        return exact_match(prediction, gold)
    predicted = Counter(normalize_answer(prediction).split())
    overlap = sum(min(count, predicted[token]) for token, count in gold_tokens.items())
    return overlap / sum(gold_tokens.values())


def first_token_substring_match(prediction: str, golds: str | Iterable[str]) -> bool:
    """The pruning oracle's criterion.

    True when the first whitespace token of the normalised prediction is non-empty
    and occurs as a character substring of some normalised gold answer. Substring,
    not token, as the paper states it: "left" matches "left lung", and so does
    "lung"; it is deliberately lenient ("no" also matches "nodule").
    """
    tokens = normalize_answer(prediction).split()
    if not tokens:
        return False
    gold_list = [golds] if isinstance(golds, str) else list(golds)
    return any(tokens[0] in normalize_answer(gold) for gold in gold_list)


def vqa_soft_accuracy(prediction: str, human_answers: Sequence[str]) -> float:
    """VQA accuracy min(#humans who gave the prediction / 3, 1).

    The official evaluator averages this over the ten leave-one-out subsets of the
    human answers; the plain form differs from it by at most a few hundredths.
    """
    if not human_answers:
        raise ValueError("VQA soft accuracy needs at least one human answer")
    predicted = normalize_answer(prediction)
    matches = sum(normalize_answer(answer) == predicted for answer in human_answers)
    return min(matches / _HUMANS_FOR_FULL_CREDIT, 1.0)


def score_sample(prediction: str, sample: VQASample) -> float:
    """The paper's per-sample accuracy: VQA soft accuracy where human answers exist,
    else exact match for closed questions and token recall for open ones."""
    if sample.answers:
        return vqa_soft_accuracy(prediction, sample.answers)
    if sample.answer_type == "closed":
        return exact_match(prediction, sample.answer)
    return token_recall(prediction, sample.answer)


@dataclass(frozen=True)
class GroupAccuracy:
    accuracy: float
    count: int


@dataclass(frozen=True)
class AccuracyReport:
    overall: GroupAccuracy
    by_answer_type: dict[str, GroupAccuracy]
    by_question_kind: dict[str, GroupAccuracy]


def aggregate_accuracy(predictions: Sequence[str], samples: Sequence[VQASample]) -> AccuracyReport:
    """Mean ``score_sample`` overall, per answer type and per question kind."""
    if len(predictions) != len(samples):
        raise ValueError(f"got {len(predictions)} predictions for {len(samples)} samples")
    if not samples:
        raise ValueError("cannot aggregate accuracy over zero samples")
    scores = [score_sample(prediction, sample) for prediction, sample in zip(predictions, samples, strict=True)]
    return AccuracyReport(
        overall=GroupAccuracy(sum(scores) / len(scores), len(scores)),
        by_answer_type=_grouped(scores, (sample.answer_type for sample in samples)),
        by_question_kind=_grouped(scores, (sample.question_kind for sample in samples)),
    )


def _grouped(scores: Sequence[float], keys: Iterable[str]) -> dict[str, GroupAccuracy]:
    groups: dict[str, list[float]] = defaultdict(list)
    for key, score in zip(keys, scores):
        groups[key].append(score)
    return {key: GroupAccuracy(sum(values) / len(values), len(values)) for key, values in sorted(groups.items())}


# The question-only baseline: what answering without the image scores (benchmarks/testbed.py,
# benchmarks/testbed_memorisation.py).
BASELINE_RULE = (
    "per exact question text, the most frequent answer among the training split's rows with that text "
    "(ties: the answer seen first); a text never seen in training falls back to the most frequent training "
    "answer of its question kind"
)


def question_only_predictions(train: Sequence[VQASample], test: Sequence[VQASample]) -> tuple[list[str], int]:
    """BASELINE_RULE's answer for each test question, and how many fell back to their kind."""
    by_text: dict[str, Counter] = defaultdict(Counter)
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for sample in train:
        by_text[sample.question][sample.answer] += 1
        by_kind[sample.question_kind][sample.answer] += 1
    overall = Counter(sample.answer for sample in train)
    predictions, fallbacks = [], 0
    for sample in test:
        if sample.question in by_text:
            predictions.append(by_text[sample.question].most_common(1)[0][0])
        else:
            fallbacks += 1
            predictions.append((by_kind.get(sample.question_kind) or overall).most_common(1)[0][0])
    return predictions, fallbacks
