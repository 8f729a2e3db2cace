"""Pruning policies: a registry of named ways to choose each sample's visual tokens.

The interface and the registry are pruning.policies.base; each other module of this package
registers its policies (off; qpriv_vl: fixed, dtp, oracle) and is imported here, so a policy's
module registers it by being in the folder.
"""

from pruning.policies.base import (
    POLICIES,
    NoOptions,
    PolicyContext,
    PolicySpec,
    Selection,
    VisualTokenSelector,
    build_policy,
    get_policy,
    policy_names,
    policy_options,
    register_policy,
)
from pruning.policies.off import KeepAll
from pruning.policies.qpriv_vl import FixedOptions, ScoredSelector
from registry import import_modules

import_modules(__name__)

__all__ = [
    "POLICIES", "FixedOptions", "KeepAll", "NoOptions", "PolicyContext", "PolicySpec", "ScoredSelector", "Selection",
    "VisualTokenSelector", "build_policy", "get_policy", "policy_names", "policy_options", "register_policy",
]
