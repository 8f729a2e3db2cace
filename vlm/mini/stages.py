"""The three stages that build the mini model, mirroring how LLaVA-1.5 came to be.

1. Vision pretraining: the CLIP-style tower learns shape and colour (CLIP's role).
2. Base: projector + decoder learn to describe images and to follow instructions
   generated from those descriptions (LLaVA's pretraining and instruction data,
   which GPT wrote from captions). Its wordings are mostly not easy-VQA's and there
   is no negation, so the base is a capable but not finished VQA model.
3. VQA: LoRA on the frozen base, on the easy-VQA training split — the same kind of
   fine-tuning the CL/FL/SL/USL simulations run, here centrally to show the target.

Why this recipe (LLAVA_NOTES.md): from scratch, shape stayed at chance; a base that
only ever saw captions left a LoRA-only VQA stage answering every yes/no question
with one constant, and a base that learned the question logic over *text*
descriptions did not transfer it to the image (yes/no stayed at the 82% prior).
So the base learns to compare a named attribute with the image (few visual tokens per
sequence make that emerge early; yes/no tasks come often and in several positive
wordings), leaving the LoRA stage easy-VQA's wordings and negation — which it learns
in two epochs, not one (README, "The offline mini model").
"""

import math
import random
from collections.abc import Callable, Sequence

import torch
from peft import PeftModel
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, get_wsd_schedule

from vlm.features import VisionFeatureCache
from vlm.lora import apply_lora
from vlm.mini.attributes import COLORS, SHAPES, ImageAttributes
from vlm.mini.recipe import MiniRecipe
from vlm.segments import (
    llava_parts,
    merge_multimodal_inputs,
    next_token_loss,
    project_visual_features,
    run_decoder_layers,
    vision_features,
)
from vqa import VQASample, build_prompt

UNKNOWN_LABEL = -1


def _optimise(
    parameters: Sequence[nn.Parameter],
    *,
    steps: int,
    lr: float,
    decay_share: float,
    step_loss: Callable[[int], torch.Tensor],
    description: str,
    progress: bool,
) -> float:
    """AdamW with warmup, a constant rate, then a cosine decay over the last `decay_share`; returns the last loss.

    A constant rate rather than a one-cycle schedule: the base stage's yes/no comparison
    emerges only after ~1000-2000 steps at the full rate and stalls when the rate has
    already decayed by then.
    """
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    schedule = get_wsd_schedule(
        optimizer, num_warmup_steps=round(0.05 * steps), num_decay_steps=round(decay_share * steps),
        num_training_steps=steps,
    )
    loss_value = float("nan")
    with tqdm(range(steps), desc=description, unit="step", disable=not progress) as bar:
        for step in bar:
            loss = step_loss(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_value = loss.item()
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss_value:.3f}")
    return loss_value


def _augment(pixel_values: torch.Tensor, generator: torch.Generator, max_shift: int) -> torch.Tensor:
    """A random symmetry of the square plus a shift: shape and colour labels survive both."""
    turns = int(torch.randint(4, (1,), generator=generator))
    pixel_values = torch.rot90(pixel_values, turns, dims=(2, 3))
    if torch.rand(1, generator=generator).item() < 0.5:
        pixel_values = pixel_values.flip(3)
    dx, dy = torch.randint(-max_shift, max_shift + 1, (2,), generator=generator).tolist()
    return torch.roll(pixel_values, shifts=(dx, dy), dims=(2, 3))


def pretrain_vision(
    model: nn.Module,
    pixel_values: torch.Tensor,
    attributes: Sequence[ImageAttributes],
    recipe: MiniRecipe,
    *,
    progress: bool = True,
) -> float:
    """Train the vision tower to tell shape and colour from its mean patch feature."""
    parts = llava_parts(model)
    width = parts.config.vision_config.hidden_size
    generator = torch.Generator().manual_seed(recipe.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        shape_head, color_head = nn.Linear(width, len(SHAPES)), nn.Linear(width, len(COLORS))
    shapes = torch.tensor([SHAPES.index(a.shape) if a.shape else UNKNOWN_LABEL for a in attributes])
    colors = torch.tensor([COLORS.index(a.color) if a.color else UNKNOWN_LABEL for a in attributes])
    parts.vision_tower.train()

    def step_loss(_: int) -> torch.Tensor:
        index = torch.randint(len(pixel_values), (recipe.vision_batch_size,), generator=generator)
        pooled = vision_features(model, _augment(pixel_values[index], generator, recipe.vision_max_shift)).mean(1)
        return F.cross_entropy(shape_head(pooled), shapes[index], ignore_index=UNKNOWN_LABEL) + F.cross_entropy(
            color_head(pooled), colors[index], ignore_index=UNKNOWN_LABEL
        )

    parameters = [*parts.vision_tower.parameters(), *shape_head.parameters(), *color_head.parameters()]
    loss = _optimise(
        parameters,
        steps=recipe.vision_steps,
        lr=recipe.vision_lr,
        decay_share=recipe.lr_decay_share,
        step_loss=step_loss,
        description="stage 1/3 vision",
        progress=progress,
    )
    parts.vision_tower.eval()
    return loss


def _generated_instruction(attributes: ImageAttributes, rng: random.Random, recipe: MiniRecipe) -> tuple[str, str]:
    """One (question, answer) made from an image's caption; yes and no equally likely."""
    tasks = ["describe"]
    if attributes.color:
        tasks += ["is_color"] * recipe.base_yes_no_weight + ["which_color"]
    if attributes.shape:
        tasks += ["is_shape"] * recipe.base_yes_no_weight + ["which_shape"]
    task = rng.choice(tasks)
    if task == "describe":
        return "Describe the image.", attributes.caption()
    if task == "which_color":
        return "Which color does the shape have?", attributes.color
    if task == "which_shape":
        return "Which shape is it?", attributes.shape
    return yes_no_instruction(attributes, "color" if task == "is_color" else "shape", rng, recipe)


def yes_no_wordings(recipe: MiniRecipe, attribute: str) -> tuple[str, ...]:
    return recipe.color_yes_no_wordings if attribute == "color" else recipe.shape_yes_no_wordings


def yes_no_instruction(
    attributes: ImageAttributes, attribute: str, rng: random.Random, recipe: MiniRecipe
) -> tuple[str, str]:
    """A yes/no question about `attribute` ("color" or "shape") in one of the recipe's
    wordings, true half of the time."""
    truth, choices = (attributes.color, COLORS) if attribute == "color" else (attributes.shape, SHAPES)
    asked = truth if rng.random() < 0.5 else rng.choice([c for c in choices if c != truth])
    return rng.choice(yes_no_wordings(recipe, attribute)).format(asked), "yes" if asked == truth else "no"


def instruction_texts(recipe: MiniRecipe) -> list[str]:
    """Every word the base stage's generated instructions can use (for the tokenizer)."""
    texts = ["Describe the image.", "Which color does the shape have?", "Which shape is it?"]
    texts += [wording.format(color) for wording in recipe.color_yes_no_wordings for color in COLORS]
    texts += [wording.format(shape) for wording in recipe.shape_yes_no_wordings for shape in SHAPES]
    return texts


def _answer_ids(tokenizer: PreTrainedTokenizerBase, answer: str) -> torch.Tensor:
    return torch.tensor(tokenizer(" " + answer)["input_ids"] + [tokenizer.eos_token_id], dtype=torch.long)


def _lm_loss(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: Sequence[torch.Tensor],
    prompts: Sequence[str],
    answers: Sequence[str],
) -> torch.Tensor:
    inputs = merge_multimodal_inputs(
        model,
        [torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.long) for prompt in prompts],
        [project_visual_features(model, feature) for feature in features],
        [_answer_ids(tokenizer, answer) for answer in answers],
    )
    logits = run_decoder_layers(
        model,
        inputs.hidden_states,
        inputs.attention_mask,
        inputs.position_ids,
        0,
        llava_parts(model).num_layers,
        apply_head=True,
    )
    return next_token_loss(logits, inputs.labels)


def _random_token_subset(features: torch.Tensor, max_tokens: int, rng: random.Random) -> torch.Tensor:
    """1..max_tokens visual tokens (log-uniform count), kept in their original order."""
    count = round(math.exp(rng.uniform(0.0, math.log(min(max_tokens, features.shape[0])))))
    return features[sorted(rng.sample(range(features.shape[0]), count))]


def train_base(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    attributes: dict[str, ImageAttributes],
    recipe: MiniRecipe,
    *,
    progress: bool = True,
) -> float:
    """Projector + decoder (+ embeddings and LM head) on captions and caption-made instructions."""
    parts = llava_parts(model)
    parts.vision_tower.requires_grad_(False)
    # dict.fromkeys: the LM head may be tied to the embeddings; optimise each tensor once.
    trainable = list(
        dict.fromkeys([*parts.projector.parameters(), *parts.language_model.parameters(), *parts.lm_head.parameters()])
    )
    few_tokens_steps = round(recipe.base_few_tokens_share * recipe.base_steps)
    described = sorted(image_id for image_id, a in attributes.items() if a.shape or a.color)
    rng = random.Random(recipe.seed)

    def step_loss(step: int) -> torch.Tensor:
        max_tokens = recipe.base_few_tokens_max if step < few_tokens_steps else parts.config.image_seq_length
        image_ids = [rng.choice(described) for _ in range(recipe.base_batch_size)]
        pairs = [
            _generated_instruction(attributes[image_id], rng, recipe) for image_id in image_ids
        ]
        return _lm_loss(
            model,
            tokenizer,
            [_random_token_subset(features[image_id], max_tokens, rng) for image_id in image_ids],
            [build_prompt(question, recipe.instruction) for question, _ in pairs],
            [answer for _, answer in pairs],
        )

    model.train()
    loss = _optimise(
        trainable, steps=recipe.base_steps, lr=recipe.base_lr, decay_share=recipe.lr_decay_share, step_loss=step_loss, description="stage 2/3 base",
        progress=progress,
    )
    model.eval()
    return loss


def train_vqa_lora(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    samples: Sequence[VQASample],
    recipe: MiniRecipe,
    *,
    progress: bool = True,
) -> tuple[PeftModel, float]:
    """LoRA (rank from the recipe) on every decoder projection; everything else frozen."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        peft_model = apply_lora(model, rank=recipe.lora_rank)
    generator = torch.Generator().manual_seed(recipe.seed)

    def step_loss(_: int) -> torch.Tensor:
        batch = [samples[i] for i in torch.randint(len(samples), (recipe.vqa_batch_size,), generator=generator)]
        return _lm_loss(
            peft_model,
            tokenizer,
            [features[sample.image_id] for sample in batch],
            [build_prompt(sample.question, recipe.instruction) for sample in batch],
            [sample.answer for sample in batch],
        )

    peft_model.train()
    loss = _optimise(
        [p for p in peft_model.parameters() if p.requires_grad],
        steps=recipe.vqa_steps,
        lr=recipe.vqa_lr,
        decay_share=recipe.lr_decay_share,
        step_loss=step_loss,
        description="stage 3/3 VQA LoRA",
        progress=progress,
    )
    peft_model.eval()
    return peft_model, loss
