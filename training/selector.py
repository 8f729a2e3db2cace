"""The seam between the frozen vision features and the projector, on the client.

A selector (pruning.VisualTokenSelector) receives a batch's vision features and its
samples (image id, question, sample id) and returns, per sample, the indices of the
visual tokens to keep. The indices stay on the client: only the projected kept
tokens, after the head's decoder layers, ever cross a cut. The run config's
`pruning.*` keys pick and parametrise a policy from pruning's registry.
"""

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from pruning import PolicyContext, VisualTokenSelector, build_policy, get_policy, policy_options
from config import SimConfig
from vqa import VQASample


def build_selector(
    config: SimConfig,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    samples: Sequence[VQASample] = (),
    cache_path: Path | None = None,
    device: str | torch.device = "cpu",
    model: nn.Module | None = None,
    instruction: str | None = None,
    pixel_values: Callable[[Sequence[VQASample]], torch.Tensor] | None = None,
) -> VisualTokenSelector:
    """The configured policy's selector; `samples` (all this client will see) get their
    frozen pruning inputs encoded once, kept at `cache_path`; `model` (the client's own) and its
    prompt `instruction` serve the policies that rank with the decoder's attention, `model` and
    `pixel_values` (its preprocessing of samples' images) those that rank inside the vision tower."""
    pruning = config.pruning
    context = PolicyContext(
        profile=config.model.profile,
        options=policy_options(get_policy(pruning.policy), asdict(pruning)),
        alpha=pruning.alpha,
        beta=pruning.beta,
        seed=pruning.seed,
        artifacts=Path(pruning.artifacts).expanduser() if pruning.artifacts else None,
        random_encoders=config.model.stage == "random",
        text_source=pruning.text_source or None,
        dino_source=pruning.dino_source or None,
        tokenizer=tokenizer,
        samples=samples,
        cache_path=cache_path,
        device=device,
        model=model,
        instruction=instruction,
        client_layers=config.client_layers,
        pixel_values=pixel_values,
    )
    return build_policy(pruning.policy, context)
