"""Policies "fastv" and "sparsevlm": visual tokens ranked by the attention the decoder itself pays them.

- fastv (Chen et al. 2024, "An Image is Worth 1/2 Tokens After Layer 2"): after layer K (2 on
  LLaVA-1.5) each visual token's score is the attention it receives at that layer, averaged
  over heads and over every token of the prompt.
- sparsevlm (Zhang et al. 2024, "SparseVLM: Visual Token Sparsification for Efficient
  Vision-Language Model Inference"): the question rates the image. Its raters are the text
  tokens after the image whose attention to the visual tokens is at least their mean; a visual
  token's score is the attention the raters pay it. SparseVLM's recycling (merging the pruned
  tokens into a few) and its progressive schedule over several layers are left out: one layer,
  pruned tokens dropped.

Both papers prune inside the decoder, the first K layers seeing every token. Every policy
here prunes on the client before the projector, so that no pruned token crosses a cut: the
selector runs the client's own embeddings, projector and layers [0, K] on the whole prompt to
rank the tokens, and the sample then runs with its kept tokens only (its first K layers see
the kept tokens, not all of them: the difference from both papers). The client must run layer
K, so in SL and USL K lies before the first cut (`split.sl_cut`, `split.cut_a`). It ranks with
its adapters switched off, the public base's layers: so a sample's ranking is the same in every
round, and whoever holds the public weights (the run's truth, an attacker that knows the
policy) draws the same keep set.
"""

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from peft import PeftModel
from torch import nn
from transformers import PreTrainedTokenizerBase

from pruning.module import keep_count
from pruning.policies.base import (
    PolicyContext,
    PolicySpec,
    RatioOptions,
    Selection,
    VisualTokenSelector,
    register_policy,
)
from pruning.profiles import get_pruning_profile
from registry import OptionError
from vlm.segments import decoder_attention, merge_multimodal_inputs, project_visual_features, run_decoder_layers
from vqa import VQASample, build_prompt

# Whose attention ranks the visual tokens.
EVERY_TOKEN, RATERS = "every token", "raters"


@dataclass
class AttentionOptions(RatioOptions):
    # The decoder layer whose attention ranks the visual tokens (FastV's K: 2 on LLaVA-1.5); the
    # client must run it, so in SL and USL it lies before the first cut.
    attention_layer: int = 2

    def validate(self) -> None:
        super().validate()
        if self.attention_layer < 0:
            raise OptionError("attention_layer", self.attention_layer, "a decoder layer index >= 0")

    def validate_for_client(self, client_layers: int) -> None:
        """Refuse a layer the client does not run (it holds layers [0, client_layers))."""
        if self.attention_layer >= client_layers:
            raise OptionError("attention_layer", self.attention_layer,
                              f"a layer the client runs before the first cut: 0..{client_layers - 1}")


class AttentionRanked:
    """Keeps each sample's top k visual tokens by the attention they receive at one decoder layer."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, instruction: str | None, layer: int,
                 ratio: float, k_min: int, readers: str) -> None:
        self.model, self.tokenizer, self.instruction = model, tokenizer, instruction
        self.layer, self.ratio, self.k_min, self.readers = layer, ratio, k_min, readers

    def prompt_ids(self, sample: VQASample) -> torch.Tensor:
        ids = self.tokenizer(build_prompt(sample.question, instruction=self.instruction), add_special_tokens=False)
        return torch.tensor(ids["input_ids"], dtype=torch.long)

    @torch.no_grad()
    def scores(self, features: torch.Tensor, samples: Sequence[VQASample]) -> torch.Tensor:
        """[B, N]: each visual token's attention score, in patch order, by the public base's layers."""
        public = self.model.disable_adapter() if isinstance(self.model, PeftModel) else nullcontext()
        with public:
            return self._scores(features, samples)

    def _scores(self, features: torch.Tensor, samples: Sequence[VQASample]) -> torch.Tensor:
        parameter = next(self.model.parameters())
        visual = project_visual_features(self.model, features.to(parameter.device, parameter.dtype))
        inputs = merge_multimodal_inputs(self.model, [self.prompt_ids(s) for s in samples], list(visual))
        hidden = inputs.hidden_states
        if self.layer:
            hidden = run_decoder_layers(self.model, hidden, inputs.attention_mask, inputs.position_ids, 0, self.layer)
        weights = decoder_attention(self.model, hidden, inputs.attention_mask, inputs.position_ids, self.layer)
        weights = weights.float().mean(1)
        scores = []
        for sample_weights, real, is_visual in zip(weights, inputs.attention_mask.bool(), inputs.visual_token_mask,
                                                    strict=True):
            to_visual = sample_weights[:, is_visual]  # [L, N]: every query row's attention to each visual token
            if self.readers == EVERY_TOKEN:
                readers = real
            else:
                after_image = torch.arange(len(real), device=real.device) > is_visual.nonzero().max()
                text = real & after_image
                paid = to_visual.sum(-1)
                # A prompt with no text after its image has no raters: every token reads.
                readers = text & (paid >= paid[text].mean()) if text.any() else real
            scores.append(to_visual[readers].mean(0))
        return torch.stack(scores)

    def __call__(self, features: torch.Tensor, samples: Sequence[VQASample]) -> Selection:
        scores = self.scores(features, samples)
        count = keep_count(self.ratio, features.shape[1], self.k_min)
        return Selection([row.topk(count).indices.sort().values.to(features.device) for row in scores])


def _builder(readers: str, policy: str):
    def build(context: PolicyContext) -> VisualTokenSelector:
        if context.model is None or context.tokenizer is None:
            raise ValueError(f"pruning policy {policy!r} ranks with the client's own decoder: it needs the model "
                             "and its tokenizer (PolicyContext.model, .tokenizer)")
        options = context.options
        if context.client_layers is not None:
            options.validate_for_client(context.client_layers)
        return AttentionRanked(context.model, context.tokenizer, context.instruction, options.attention_layer,
                               options.ratio, get_pruning_profile(context.profile).k_min, readers)

    return build


register_policy(PolicySpec("fastv", _builder(EVERY_TOKEN, "fastv"), AttentionOptions, budget="ratio"))
register_policy(PolicySpec("sparsevlm", _builder(RATERS, "sparsevlm"), AttentionOptions, budget="ratio"))
