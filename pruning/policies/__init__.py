"""Pruning policies: a registry of named ways to choose each sample's visual tokens.

The interface and the registry are pruning.policies.base; each other module of this package
registers its policies and is imported here, so a policy's module registers it by being in
the folder (`qpriv_vl` registers fixed, dtp and oracle).
"""

from pruning.policies.base import (
    POLICIES,
    NoOptions,
    PolicyContext,
    PolicySpec,
    RatioOptions,
    Selection,
    VisualTokenSelector,
    build_policy,
    get_policy,
    policy_names,
    policy_options,
    register_policy,
)
from pruning.policies.off import KeepAll
from pruning.policies.qpriv_vl import ScoredSelector
from registry import import_modules

import_modules(__name__)

__all__ = [
    "POLICIES", "KeepAll", "NoOptions", "PolicyContext", "PolicySpec", "RatioOptions", "ScoredSelector", "Selection",
    "VisualTokenSelector", "build_policy", "get_policy", "policy_names", "policy_options", "register_policy",
]
