"""The data layer: VQA datasets as one sample schema, partitions, prompts, scoring;
the stamped privacy benchmark and the privacy bags of the sensitivity teacher."""

import vqa.adapters  # noqa: F401  (registers the built-in datasets)
from vqa.adapters.easyvqa_stamped import StampedEasyVQAAdapter
from vqa.adapters.scenes import ScenesAdapter
from vqa.answers import canonical_answer, normalize_answer
from vqa.errors import RowProblem, VQADataError
from vqa.images import ImageRef, to_rgb
from vqa.partition import partition_dataset, partition_indices, register_partitioner
from vqa.privacy_bags import (
    PRIVATE,
    PUBLIC,
    BagImage,
    load_privacy_bags,
    privacy_bag_names,
    register_privacy_bags,
)
from vqa.prompts import (
    IMAGE_PLACEHOLDER,
    SHORT_ANSWER_INSTRUCTION,
    PromptPair,
    build_follow_up_prompt,
    build_in_context_prompt,
    build_prompt,
    build_training_pair,
)
from vqa.registry import (
    DatasetAdapter,
    SourceRow,
    SourceTable,
    UnknownQuestionKind,
    dataset_names,
    get_adapter,
    is_stamped,
    load_vqa,
    mark_records,
    register_dataset,
)
from vqa.schema import AnswerType, VQADataset, VQASample
from vqa.scoring import (
    BASELINE_RULE,
    AccuracyReport,
    GroupAccuracy,
    aggregate_accuracy,
    exact_match,
    first_token_substring_match,
    question_only_predictions,
    score_sample,
    token_recall,
    vqa_soft_accuracy,
)
from vqa.scenes import REFUSAL_ANSWER, SceneSpec, SceneSpecError, needed_patches
from vqa.stamping import MarkRecord, StampSpec, mark_patches

__all__ = [
    "BASELINE_RULE",
    "IMAGE_PLACEHOLDER",
    "PRIVATE",
    "PUBLIC",
    "SHORT_ANSWER_INSTRUCTION",
    "AccuracyReport",
    "AnswerType",
    "BagImage",
    "DatasetAdapter",
    "GroupAccuracy",
    "ImageRef",
    "MarkRecord",
    "PromptPair",
    "RowProblem",
    "SourceRow",
    "SourceTable",
    "StampSpec",
    "REFUSAL_ANSWER",
    "SceneSpec",
    "SceneSpecError",
    "ScenesAdapter",
    "StampedEasyVQAAdapter",
    "UnknownQuestionKind",
    "VQADataError",
    "VQADataset",
    "VQASample",
    "aggregate_accuracy",
    "build_follow_up_prompt",
    "build_in_context_prompt",
    "build_prompt",
    "build_training_pair",
    "canonical_answer",
    "dataset_names",
    "exact_match",
    "first_token_substring_match",
    "get_adapter",
    "load_privacy_bags",
    "load_vqa",
    "is_stamped",
    "mark_patches",
    "mark_records",
    "needed_patches",
    "normalize_answer",
    "partition_dataset",
    "partition_indices",
    "privacy_bag_names",
    "question_only_predictions",
    "register_dataset",
    "register_partitioner",
    "register_privacy_bags",
    "score_sample",
    "to_rgb",
    "token_recall",
    "vqa_soft_accuracy",
]
