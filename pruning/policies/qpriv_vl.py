"""The QPriv-VL policies: patches ranked by the fused score c of a QPriv-VL module, each sample's top k kept.

- fixed: the same ρ for every sample (`pruning.ratio`). The scorer is the trained module in
  `pruning.artifacts` when one is given (so fixed ratios and DTP differ only in how many
  patches they keep), otherwise a seeded untrained module — the kind of fixed random
  scorer the oracle search uses (with trained towers, its Wq/Wk are their pretrained
  relevance read-out, as the oracle's are: pruning.towers).
- dtp: the trained module's own ρ̂ and ranking (artefact `dtp.pt`).
- oracle: each sample's ρ* from the prepared table (artefact `oracle.pt`), ranked by the
  scorer that table was searched with.
"""

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pruning.artifacts import (
    DTP_FILE,
    ORACLE_FILE,
    ArtifactError,
    load_dtp,
    load_oracle,
    oracle_key,
)
from pruning.encoders import FrozenEncoders
from pruning.inputs import PruningInputCache
from pruning.module import QPrivVL, QPrivVLOutput, build_qpriv_vl, keep_indices
from pruning.policies.base import (
    PolicyContext,
    PolicySpec,
    RatioOptions,
    Selection,
    VisualTokenSelector,
    register_policy,
)
from pruning.profiles import PruningProfile, get_pruning_profile
from pruning.towers import adopt_readout, load_encoders
from vqa import VQASample


RatioSource = Callable[[QPrivVLOutput, Sequence[VQASample]], Sequence[float] | torch.Tensor]


class FixedRatio:
    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def __call__(self, output: QPrivVLOutput, samples: Sequence[VQASample]) -> list[float]:
        return [self.ratio] * len(samples)


class PredictedRatio:
    """DTP: the module's own per-sample ρ̂."""

    def __call__(self, output: QPrivVLOutput, samples: Sequence[VQASample]) -> torch.Tensor:
        return output.ratio


class OracleRatio:
    def __init__(self, ratios: dict[str, float], source: Path) -> None:
        self.ratios, self.source = ratios, source

    def __call__(self, output: QPrivVLOutput, samples: Sequence[VQASample]) -> list[float]:
        keys = [oracle_key(sample) for sample in samples]
        missing = [key for key in keys if key not in self.ratios]
        if missing:
            raise KeyError(
                f"the oracle table {self.source} has no ratio for samples {missing[:5]} "
                f"({len(self.ratios)} samples searched); run the oracle on these samples"
            )
        return [self.ratios[key] for key in keys]


class ScoredSelector:
    """Ranks patches by a QPriv-VL module's fused score and keeps each sample's top k,
    k = max(k_min, round((1 − ρ)·N)) with ρ from `ratios`."""

    def __init__(self, scorer: QPrivVL, inputs: PruningInputCache, ratios: RatioSource) -> None:
        self.scorer, self.inputs, self.ratios = scorer, inputs, ratios

    @torch.no_grad()
    def score(self, features: torch.Tensor, samples: Sequence[VQASample]) -> QPrivVLOutput:
        """The module's forward on a batch: every map and the predicted ratio."""
        self.inputs.add(samples)
        parameter = next(self.scorer.parameters())
        as_scorer = {"device": parameter.device, "dtype": parameter.dtype}
        return self.scorer(
            features.to(**as_scorer),
            self.inputs.question_vectors(samples).to(**as_scorer),
            self.inputs.dino_patches(samples).to(**as_scorer),
        )

    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        output = self.score(features, samples)
        keep = keep_indices(output.score, self.ratios(output, samples), self.scorer.profile.k_min)
        return Selection([indices.to(features.device) for indices in keep], output.sensitivity)


def _prepared_inputs(profile: PruningProfile, context: PolicyContext) -> tuple[FrozenEncoders, PruningInputCache]:
    """The frozen encoders' per-sample inputs, loaded from and saved to the cache path."""
    if context.tokenizer is None:
        raise ValueError("QPriv-VL policies need the decoder's tokenizer (PolicyContext.tokenizer)")
    encoders = load_encoders(
        profile,
        tokenizer=context.tokenizer,
        random_weights=context.random_encoders,
        text_source=context.text_source,
        dino_source=context.dino_source,
    ).to(context.device)
    inputs = PruningInputCache(encoders)
    if context.cache_path is not None and context.cache_path.exists():
        inputs.load(context.cache_path)
    inputs.add(context.samples)
    if context.cache_path is not None:
        inputs.save(context.cache_path)
    return encoders, inputs


def _check_artifact(context: PolicyContext, policy: str, file: str) -> Path:
    """The artefacts folder holding `file`, checked before any encoder loads (fail in milliseconds)."""
    if context.artifacts is None or not (context.artifacts / file).is_file():
        raise ArtifactError(
            f"pruning policy {policy!r} needs {file} in the prepared artefacts folder (pruning.artifacts); "
            f"got {context.artifacts}"
        )
    return context.artifacts


def _build_fixed(context: PolicyContext) -> VisualTokenSelector:
    profile = get_pruning_profile(context.profile)
    folder = None if context.artifacts is None else _check_artifact(context, "fixed", DTP_FILE)
    encoders, inputs = _prepared_inputs(profile, context)
    if folder is None:
        scorer = build_qpriv_vl(profile, seed=context.seed, alpha=context.alpha, beta=context.beta).eval()
        # Trained towers come with their pretrained relevance pair, which prepare's fixed scorer also ranks with.
        adopt_readout(scorer, encoders)
    else:
        scorer = load_dtp(folder, profile, encoders, alpha=context.alpha, beta=context.beta)
    return ScoredSelector(scorer.to(context.device), inputs, FixedRatio(context.options.ratio))


def _build_dtp(context: PolicyContext) -> VisualTokenSelector:
    profile = get_pruning_profile(context.profile)
    folder = _check_artifact(context, "dtp", DTP_FILE)
    encoders, inputs = _prepared_inputs(profile, context)
    module = load_dtp(folder, profile, encoders, alpha=context.alpha, beta=context.beta)
    return ScoredSelector(module.to(context.device), inputs, PredictedRatio())


def _build_oracle(context: PolicyContext) -> VisualTokenSelector:
    profile = get_pruning_profile(context.profile)
    folder = _check_artifact(context, "oracle", ORACLE_FILE)
    encoders, inputs = _prepared_inputs(profile, context)
    scorer, ratios = load_oracle(folder, profile, encoders, alpha=context.alpha, beta=context.beta)
    return ScoredSelector(scorer.to(context.device), inputs, OracleRatio(ratios, folder / ORACLE_FILE))


register_policy(PolicySpec("fixed", _build_fixed, RatioOptions, budget="ratio"))
register_policy(PolicySpec("dtp", _build_dtp, required_artifact=DTP_FILE))
register_policy(PolicySpec("oracle", _build_oracle, required_artifact=ORACLE_FILE))
