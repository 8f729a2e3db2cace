"""Answering VQA questions with a (possibly pruned) model, for scoring.

One function for every caller (the mini model's build, its target benchmark, the
simulations' evaluation), so a number in results/ and a number in a run folder
come from the same code.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from vlm.features import VisionFeatureCache
from vlm.segments import greedy_generate, llava_parts, project_visual_features
from vqa import VQASample, build_in_context_prompt

# Per-sample visual tokens before projection, [N, Dv] -> [k, Dv]: pruning, ablations.
VisualTokenTransform = Callable[[VQASample, torch.Tensor], torch.Tensor]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[VQASample],
    instruction: str | None,
    demonstrations: Sequence[Sequence[VQASample]] | None = None,
) -> list[torch.Tensor]:
    """Each sample's prompt ids; with `demonstrations` (per sample), its in-context
    demonstrations first, one image placeholder per demonstration and one for the sample."""
    demonstrations = demonstrations if demonstrations is not None else [()] * len(samples)
    if len(demonstrations) != len(samples):
        raise ValueError(f"got {len(samples)} samples but {len(demonstrations)} demonstration sets")
    return [
        torch.tensor(tokenizer(build_in_context_prompt(
            [(d.question, d.answer) for d in demos], sample.question, instruction, end_of_turn=tokenizer.eos_token,
        ))["input_ids"], dtype=torch.long)
        for sample, demos in zip(samples, demonstrations, strict=True)
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
    demonstrations: Sequence[Sequence[VQASample]] | None = None,
    intervention: Callable[[], AbstractContextManager] | None = None,
    batch_size: int = 256,
    max_new_tokens: int = 8,
    progress: bool = True,
) -> list[str]:
    """Greedy answers to `samples`; `visual_tokens` may drop, reorder or swap a sample's visual
    tokens first; `demonstrations` (per sample) go before it in context, each with all its tokens;
    `intervention()` is entered around each batch's generation (a task vector's head replacement)."""
    was_training = model.training
    model.eval()
    device = llava_parts(model).lm_head.weight.device
    answers: list[str] = []
    for start in tqdm(range(0, len(samples), batch_size), desc="answering", unit="batch", disable=not progress):
        batch = samples[start : start + batch_size]
        batch_demonstrations = None if demonstrations is None else demonstrations[start : start + batch_size]
        visual = []
        for index, sample in enumerate(batch):
            tokens = features[sample.image_id]
            if visual_tokens is not None:
                tokens = visual_tokens(sample, tokens)
            shown = [] if batch_demonstrations is None else batch_demonstrations[index]
            visual.append([*(project_visual_features(model, features[d.image_id].to(device)) for d in shown),
                           project_visual_features(model, tokens.to(device))])
        with intervention() if intervention is not None else nullcontext():
            generated = greedy_generate(
                model,
                encode_prompts(tokenizer, batch, instruction, batch_demonstrations),
                visual,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
            )
        answers.extend(tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in generated)
    model.train(was_training)
    return answers
