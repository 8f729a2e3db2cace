"""QPriv-VL: question-guided, privacy-aware visual-token pruning (Dynamic Threshold Predictor).

- pruning.profiles: the sizes per model profile (encoders, P, head widths)
- pruning.encoders: the frozen CLIP text tower and DINOv2 (real or seeded random)
- pruning.towers: the small profiles' trained towers (`qpriv-prune towers`) and `load_encoders`
- pruning.module: QPrivVL (relevance, sensitivity, fusion, threshold head) and the keep rule
- pruning.inputs: the encoders' per-sample outputs, computed once and cached
- pruning.artifacts: the trained module and the oracle table on disk
- pruning.policies: the policies' registry and their selectors, a module per family (off; qpriv_vl: fixed, dtp, oracle)
- pruning.metrics: keep-count and exclusion-ratio summaries, the per-round pruning record
- pruning.prepare: "prepare DTP" (oracle, teacher, student) into an artefacts folder; `qpriv-prune prepare`
"""

from pruning.artifacts import (
    DTP_FILE,
    ORACLE_FILE,
    ArtifactError,
    load_dtp,
    load_oracle,
    oracle_key,
    save_dtp,
    save_oracle,
)
from pruning.encoders import (
    FrozenEncoders,
    RelevanceReadout,
    build_random_encoders,
    load_pretrained_encoders,
)
from pruning.inputs import PruningInputCache
from pruning.metrics import (
    ExclusionSummary,
    KeepCountSummary,
    PruningRecord,
    sensitivity_exclusion_ratios,
    summarize_exclusion,
    summarize_keep_counts,
)
from pruning.module import (
    QPrivVL,
    QPrivVLOutput,
    build_qpriv_vl,
    keep_count,
    keep_indices,
)
from pruning.policies import (
    POLICIES,
    KeepAll,
    NoOptions,
    PolicyContext,
    PolicySpec,
    RatioOptions,
    ScoredSelector,
    Selection,
    VisualTokenSelector,
    build_policy,
    get_policy,
    policy_names,
    policy_options,
    register_policy,
)
from pruning.profiles import (
    PRUNING_PROFILES,
    PruningProfile,
    TowerRecipe,
    get_pruning_profile,
    pruning_profile_names,
    register_pruning_profile,
)
from pruning.towers import (
    TowerSource,
    load_encoders,
    load_trained_encoders,
    train_towers,
)

__all__ = [
    "DTP_FILE",
    "ORACLE_FILE",
    "ArtifactError",
    "ExclusionSummary",
    "FrozenEncoders",
    "KeepAll",
    "KeepCountSummary",
    "NoOptions",
    "POLICIES",
    "PRUNING_PROFILES",
    "PruningRecord",
    "PolicyContext",
    "PolicySpec",
    "PruningInputCache",
    "PruningProfile",
    "QPrivVL",
    "QPrivVLOutput",
    "RatioOptions",
    "RelevanceReadout",
    "ScoredSelector",
    "Selection",
    "TowerRecipe",
    "TowerSource",
    "VisualTokenSelector",
    "build_policy",
    "build_qpriv_vl",
    "build_random_encoders",
    "get_policy",
    "get_pruning_profile",
    "keep_count",
    "keep_indices",
    "load_dtp",
    "load_encoders",
    "load_oracle",
    "load_pretrained_encoders",
    "load_trained_encoders",
    "oracle_key",
    "policy_names",
    "policy_options",
    "pruning_profile_names",
    "register_policy",
    "register_pruning_profile",
    "save_dtp",
    "save_oracle",
    "sensitivity_exclusion_ratios",
    "summarize_exclusion",
    "summarize_keep_counts",
    "train_towers",
]
