"""Answering VQA questions with a (possibly pruned) model, for scoring.

One function for every caller (the mini model's build, its target benchmark, the
simulations' evaluation), so a number in the README and a number in a run folder
come from the same code.
"""

from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from vlm.features import VisionFeatureCache
from vlm.segments import greedy_generate, project_visual_features
from vqa import VQASample, build_prompt

# Per-sample visual tokens before projection, [N, Dv] -> [k, Dv]: pruning, ablations.
VisualTokenTransform = Callable[[VQASample, torch.Tensor], torch.Tensor]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, samples: Sequence[VQASample], instruction: str | None
) -> list[torch.Tensor]:
    return [
        torch.tensor(tokenizer(build_prompt(sample.question, instruction))["input_ids"], dtype=torch.long)
        for sample in samples
    ]


@torch.no_grad()
def answer_questions(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    samples: Sequence[VQASample],
    *,
    instruction: str | None,
    visual_tokens: VisualTokenTransform | None = None,
    batch_size: int = 256,
    max_new_tokens: int = 8,
    progress: bool = True,
) -> list[str]:
    """Greedy answers to `samples`; `visual_tokens` may drop, reorder or swap visual tokens first."""
    was_training = model.training
    model.eval()
    answers: list[str] = []
    for start in tqdm(range(0, len(samples), batch_size), desc="answering", unit="batch", disable=not progress):
        batch = samples[start : start + batch_size]
        visual = []
        for sample in batch:
            tokens = features[sample.image_id]
            if visual_tokens is not None:
                tokens = visual_tokens(sample, tokens)
            visual.append(project_visual_features(model, tokens))
        generated = greedy_generate(
            model,
            encode_prompts(tokenizer, batch, instruction),
            visual,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
        )
        answers.extend(tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in generated)
    model.train(was_training)
    return answers
