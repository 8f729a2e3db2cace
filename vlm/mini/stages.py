"""The three stages that build the mini model, mirroring how LLaVA-1.5 came to be.

1. Vision pretraining: the CLIP-style tower learns shape and colour (CLIP's role),
   from the mean of its patch tokens and from each token alone.
2. Base: projector + decoder learn to describe images and to follow instructions
   generated from those descriptions (LLaVA's pretraining and instruction data,
   which GPT wrote from captions). Its wordings are mostly not easy-VQA's and there
   is no negation, so the base is a capable but not finished VQA model.
3. VQA: LoRA on the frozen base, on the easy-VQA training split — the same kind of
   fine-tuning the CL/FL/SL/USL simulations run, here centrally to show the target.
   Like LLaVA-1.5's, its sequences are multi-turn conversations about one image, so
   the 64 visual tokens are paid once for several questions (the CPU budget is per
   token); the base's all-token steps are conversations too. A recipe with
   `base_interleaved_share` (the mini-interleaved profile) also gives the base multi-image
   conversations, in-context demonstrations and a target, as interleaved-data VLMs learn.

Why this recipe (LLAVA_NOTES.md): trained end to end from scratch, the model never
learns shape, hence the vision stage; a base that only sees captions gives a LoRA-only
VQA stage no comparison to answer yes/no with; and question logic learned over *text*
descriptions does not transfer to the image. So the base itself learns to compare a
named attribute with the image: few visual tokens per sequence make that emerge early,
yes/no tasks come often and in several positive wordings, and a text-only task teaches
reading the attribute a question names, which the comparison needs and nothing else
teaches. That leaves the LoRA stage easy-VQA's wordings and negation, about two epochs
of work. When the comparison emerges still varies with the seed, so the base checks it
as it trains and starts again from another seed if it never comes.
"""

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from peft import PeftModel
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from vlm.answering import answer_questions
from vlm.features import VisionFeatureCache
from vlm.lora import apply_lora
from vlm.mini.attributes import COLORS, SHAPES, ImageAttributes, image_attributes
from vlm.mini.recipe import MiniRecipe
from vlm.segments import (
    llava_parts,
    merge_multimodal_inputs,
    next_token_loss,
    project_visual_features,
    run_decoder_layers,
    vision_features,
)
from vqa import VQASample, aggregate_accuracy, build_follow_up_prompt, build_in_context_prompt, build_prompt

UNKNOWN_LABEL = -1


@dataclass
class StageSchedule:
    """Learning-rate multiplier per step: linear warmup, a constant rate, then a cosine decay to zero.

    The same curve as transformers' `get_wsd_schedule`, written out because the base
    stage lengthens the constant part while it runs (until its check passes), which a
    schedule fixed at construction cannot do. A constant rate rather than a one-cycle
    schedule: the base's yes/no comparison takes hundreds of steps (thousands, before
    the repeat task) at the full rate to emerge and stalls if the rate has decayed by then.
    """

    warmup_steps: int
    constant_steps: int
    decay_steps: int

    @classmethod
    def with_decay_share(cls, steps: int, decay_share: float) -> "StageSchedule":
        warmup_steps, decay_steps = round(0.05 * steps), round(decay_share * steps)
        return cls(warmup_steps, steps - warmup_steps - decay_steps, decay_steps)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.constant_steps + self.decay_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        decay_progress = (step - self.warmup_steps - self.constant_steps) / max(1, self.decay_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, decay_progress))))


def _optimise(
    parameters: Sequence[nn.Parameter],
    *,
    lr: float,
    schedule: StageSchedule,
    step_loss: Callable[[int], torch.Tensor],
    description: str,
    progress: bool,
    after_step: Callable[[int], dict[str, str] | None] | None = None,
) -> float:
    """AdamW on `schedule` until its (possibly growing) total; returns the last loss.

    `after_step(steps_done)` may check the model, lengthen the schedule, or stop the
    run by raising; what it returns joins the progress bar's readout.
    """
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    loss_value = float("nan")
    readout: dict[str, str] = {}
    step = 0
    with tqdm(total=schedule.total_steps, desc=description, unit="step", disable=not progress) as bar:
        while step < schedule.total_steps:
            loss = step_loss(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lr_schedule.step()
            loss_value = loss.item()
            checked = after_step(step + 1) if after_step else None
            if step % 20 == 0 or checked:
                readout |= {"loss": f"{loss_value:.3f}"} | (checked or {})
                bar.set_postfix(readout, refresh=False)
            bar.total = schedule.total_steps
            bar.update()
            step += 1
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
    """Train the vision tower to tell shape and colour from its mean patch feature and from each patch token."""
    parts = llava_parts(model)
    width = parts.config.vision_config.hidden_size
    generator = torch.Generator().manual_seed(recipe.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        shape_head, color_head = nn.Linear(width, len(SHAPES)), nn.Linear(width, len(COLORS))
        vision = parts.config.vision_config
        position_head = nn.Linear(width, (vision.image_size // vision.patch_size) ** 2)
    shapes = torch.tensor([SHAPES.index(a.shape) if a.shape else UNKNOWN_LABEL for a in attributes])
    colors = torch.tensor([COLORS.index(a.color) if a.color else UNKNOWN_LABEL for a in attributes])
    parts.vision_tower.train()

    def attribute_loss(features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Shape + colour cross-entropy of `features` [..., width] against the images' labels."""
        shape_labels = shapes[index].expand(features.shape[:-1])
        color_labels = colors[index].expand(features.shape[:-1])
        return F.cross_entropy(
            shape_head(features).flatten(0, -2), shape_labels.flatten(), ignore_index=UNKNOWN_LABEL
        ) + F.cross_entropy(color_head(features).flatten(0, -2), color_labels.flatten(), ignore_index=UNKNOWN_LABEL)

    def step_loss(_: int) -> torch.Tensor:
        index = torch.randint(len(pixel_values), (recipe.vision_batch_size,), generator=generator)
        features = vision_features(model, _augment(pixel_values[index], generator, recipe.vision_max_shift))
        loss = attribute_loss(features.mean(1), index)
        if recipe.vision_token_loss_weight:
            # [tokens, images, width]: each image's labels broadcast over its tokens.
            loss = loss + recipe.vision_token_loss_weight * attribute_loss(features.transpose(0, 1), index)
        if recipe.vision_position_loss_weight:
            patches = torch.arange(features.shape[1]).expand(features.shape[:2])
            loss = loss + recipe.vision_position_loss_weight * F.cross_entropy(
                position_head(features).flatten(0, 1), patches.flatten())
        return loss

    parameters = [*parts.vision_tower.parameters(), *shape_head.parameters(), *color_head.parameters()]
    if recipe.vision_position_loss_weight:
        parameters += list(position_head.parameters())
    loss = _optimise(
        parameters,
        lr=recipe.vision_lr,
        schedule=StageSchedule.with_decay_share(recipe.vision_steps, recipe.lr_decay_share),
        step_loss=step_loss,
        description="stage 1/3 vision",
        progress=progress,
    )
    parts.vision_tower.eval()
    return loss


def _generated_instruction(attributes: ImageAttributes, rng: random.Random, recipe: MiniRecipe) -> tuple[str, str]:
    """One (question, answer) made from an image's caption; yes and no equally likely."""
    tasks = ["describe"]
    for attribute in ("color", "shape"):
        if getattr(attributes, attribute):
            tasks += [f"is_{attribute}"] * recipe.base_yes_no_weight + [f"which_{attribute}"]
            tasks += [f"repeat_{attribute}"] * recipe.base_repeat_weight
    return _task_instruction(rng.choice(tasks), attributes, rng, recipe)


def _task_instruction(task: str, attributes: ImageAttributes, rng: random.Random, recipe: MiniRecipe) -> tuple[str, str]:
    """(question, answer) of one task ("describe", "is_color", "which_shape", "repeat_color", ...) about an image."""
    task, _, attribute = task.partition("_")
    if task == "describe":
        return "Describe the image.", attributes.caption()
    if task == "which" and attribute == "color":
        return "Which color does the shape have?", attributes.color
    if task == "which":
        return "Which shape is it?", attributes.shape
    if task == "is":
        return yes_no_instruction(attributes, attribute, rng, recipe)
    question, asked, _ = _named_yes_no_question(attributes, attribute, rng, recipe)
    return repeat_instruction(attribute, question), asked


# The tasks of interleaved conversations: what an image has to show for each, and whether
# it can be asked with an uninformative question (a yes/no question must name a value).
_INTERLEAVED_TASKS = {
    "describe": (None, True), "which_color": ("color", True), "which_shape": ("shape", True),
    "is_color": ("color", False), "is_shape": ("shape", False),
}


def interleaved_conversation(
    attributes: Mapping[str, ImageAttributes], image_ids: Sequence[str], rng: random.Random, recipe: MiniRecipe
) -> list[tuple[str, str, str]]:
    """(image id, question, answer) of 1..base_interleaved_max_demos demonstrations and a last
    target, all of one task; with base_interleaved_hidden_share, every turn asks one
    uninformative question (recipe.interleaved_hidden_questions), so the task is in the answers."""
    hidden = rng.random() < recipe.base_interleaved_hidden_share
    task = rng.choice([name for name, (_, askable) in _INTERLEAVED_TASKS.items() if askable or not hidden])
    needs = _INTERLEAVED_TASKS[task][0]
    candidates = [image_id for image_id in image_ids if needs is None or getattr(attributes[image_id], needs)]
    chosen = rng.sample(candidates, rng.randint(1, recipe.base_interleaved_max_demos) + 1)
    question = rng.choice(recipe.interleaved_hidden_questions)
    turns = []
    for image_id in chosen:
        asked, answer = _task_instruction(task, attributes[image_id], rng, recipe)
        turns.append((image_id, question if hidden else asked, answer))
    return turns


def distinct_instructions(
    attributes: ImageAttributes, count: int, rng: random.Random, recipe: MiniRecipe
) -> list[tuple[str, str]]:
    """`count` generated instructions with different questions: a repeated question
    could be answered from the conversation instead of from the image."""
    instructions: dict[str, str] = {}
    while len(instructions) < count:
        question, answer = _generated_instruction(attributes, rng, recipe)
        instructions.setdefault(question, answer)
    return list(instructions.items())


def yes_no_wordings(recipe: MiniRecipe, attribute: str) -> tuple[str, ...]:
    return recipe.color_yes_no_wordings if attribute == "color" else recipe.shape_yes_no_wordings


def _named_yes_no_question(
    attributes: ImageAttributes, attribute: str, rng: random.Random, recipe: MiniRecipe
) -> tuple[str, str, str]:
    """(question, the value it names, the image's value): a question about `attribute`
    ("color" or "shape") in one of the recipe's wordings, naming the true value half of the time."""
    truth, choices = (attributes.color, COLORS) if attribute == "color" else (attributes.shape, SHAPES)
    asked = truth if rng.random() < 0.5 else rng.choice([c for c in choices if c != truth])
    return rng.choice(yes_no_wordings(recipe, attribute)).format(asked), asked, truth


def yes_no_instruction(
    attributes: ImageAttributes, attribute: str, rng: random.Random, recipe: MiniRecipe
) -> tuple[str, str]:
    """A yes/no question about `attribute` in one of the recipe's wordings, true half of the time."""
    question, asked, truth = _named_yes_no_question(attributes, attribute, rng, recipe)
    return question, "yes" if asked == truth else "no"


def repeat_instruction(attribute: str, question: str) -> str:
    """Text-only reading: repeat the colour or shape a yes/no question names (see the recipe)."""
    return f"Repeat the {attribute}: {question}"


def instruction_texts(recipe: MiniRecipe) -> list[str]:
    """Every word the base stage's generated instructions can use (for the tokenizer)."""
    texts = ["Describe the image.", "Which color does the shape have?", "Which shape is it?"]
    yes_no = {
        attribute: [wording.format(value) for wording in yes_no_wordings(recipe, attribute) for value in values]
        for attribute, values in (("color", COLORS), ("shape", SHAPES))
    }
    texts += [question for questions in yes_no.values() for question in questions]
    texts += [repeat_instruction(attribute, questions[0]) for attribute, questions in yes_no.items()]
    if recipe.base_interleaved_share:
        texts += list(recipe.interleaved_hidden_questions)
    return texts


def _token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _lm_loss(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: Sequence[torch.Tensor],
    conversations: Sequence[Sequence[tuple[str, str]]],
    instruction: str | None,
) -> torch.Tensor:
    """Next-token loss on the answers of per-image conversations of (question, answer) turns.

    The first turn shows the image; each later turn is a follow-up with no image, as in
    LLaVA-1.5's multi-turn training data. Only answers (and their end token) are learned.
    """
    continuations, label_masks = [], []
    for turns in conversations:
        ids, learned = [], []
        for turn, (question, answer) in enumerate(turns):
            if turn:
                follow_up = _token_ids(tokenizer, build_follow_up_prompt(question, instruction))
                ids += follow_up
                learned += [False] * len(follow_up)
            answer_ids = _token_ids(tokenizer, " " + answer) + [tokenizer.eos_token_id]
            ids += answer_ids
            learned += [True] * len(answer_ids)
        continuations.append(torch.tensor(ids, dtype=torch.long))
        label_masks.append(torch.tensor(learned))
    inputs = merge_multimodal_inputs(
        model,
        [torch.tensor(_token_ids(tokenizer, build_prompt(turns[0][0], instruction))) for turns in conversations],
        [project_visual_features(model, feature) for feature in features],
        continuations,
        answer_label_masks=label_masks,
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


def _in_context_loss(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    visual: Sequence[Sequence[torch.Tensor]],
    conversations: Sequence[Sequence[tuple[str, str]]],
    instruction: str | None,
) -> torch.Tensor:
    """Next-token loss on the last turn's answer of multi-image conversations (each turn its own
    image): the earlier turns are in-context demonstrations."""
    prompts = [
        torch.tensor(_token_ids(tokenizer, build_in_context_prompt(
            turns[:-1], turns[-1][0], instruction, end_of_turn=tokenizer.eos_token)))
        for turns in conversations
    ]
    answers = [torch.tensor(_token_ids(tokenizer, " " + turns[-1][1]) + [tokenizer.eos_token_id]) for turns in conversations]
    inputs = merge_multimodal_inputs(
        model, prompts, [[project_visual_features(model, tokens) for tokens in images] for images in visual], answers
    )
    logits = run_decoder_layers(
        model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, llava_parts(model).num_layers,
        apply_head=True,
    )
    return next_token_loss(logits, inputs.labels)


@dataclass
class BaseAttempt:
    """One run of the base stage and its checks of the yes/no comparison.

    `yes_no_checks` maps few-token steps done to own-wording yes/no accuracy on the
    held-out images (few visual tokens, as trained then); `final_yes_no` is the same
    after the whole stage, with all visual tokens.
    """

    seed: int
    yes_no_checks: dict[int, float] = field(default_factory=dict)
    learned_at_step: int | None = None
    few_token_steps: int | None = None
    final_loss: float | None = None
    final_yes_no: float | None = None


class BaseComparisonStalled(RuntimeError):
    """The base did not learn to compare a named attribute with the image within its few-token steps."""

    def __init__(self, attempt: BaseAttempt, recipe: MiniRecipe) -> None:
        self.attempt = attempt
        checks = ", ".join(f"step {step}: {accuracy:.0%}" for step, accuracy in attempt.yes_no_checks.items())
        super().__init__(
            f"base stage (seed {attempt.seed}): own-wording yes/no on held-out images still below "
            f"base_check_accuracy={recipe.base_check_accuracy:.0%} after "
            f"base_few_tokens_max_steps={recipe.base_few_tokens_max_steps} few-token steps ({checks})"
        )


def own_wording_yes_no(
    samples: Sequence[VQASample], attributes: Mapping[str, ImageAttributes], recipe: MiniRecipe, rng: random.Random
) -> list[VQASample]:
    """A colour and a shape yes/no question per image of `samples`, in the base stage's own wordings.

    Whether the base compares a named attribute with the image, before the VQA stage
    teaches easy-VQA's wordings and negation.
    """
    first_sample = {s.image_id: s for s in reversed(samples)}
    questions = []
    for image_id in sorted(first_sample):
        for attribute in ("color", "shape"):
            if getattr(attributes[image_id], attribute):
                question, answer = yes_no_instruction(attributes[image_id], attribute, rng, recipe)
                kind = f"base {attribute} yes/no"
                questions.append(replace(first_sample[image_id], question=question, answer=answer, question_kind=kind))
    return questions


def _yes_no_accuracy(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    questions: Sequence[VQASample],
    recipe: MiniRecipe,
    visual_tokens: int | None,
) -> float:
    """Accuracy on `questions` from `visual_tokens` random tokens per image (the same ones every call), or all."""
    rng = random.Random(recipe.seed)

    def keep(_: VQASample, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[sorted(rng.sample(range(tokens.shape[0]), min(visual_tokens, tokens.shape[0])))]

    answers = answer_questions(
        model, tokenizer, features, questions, instruction=recipe.instruction,
        visual_tokens=keep if visual_tokens else None, max_new_tokens=2, progress=False,
    )
    return aggregate_accuracy(answers, questions).overall.accuracy


def train_base(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    samples: Sequence[VQASample],
    recipe: MiniRecipe,
    *,
    seed: int,
    progress: bool = True,
) -> BaseAttempt:
    """Projector + decoder (+ embeddings and LM head) on captions and caption-made instructions.

    Every `base_check_every` few-token steps the base answers own-wording yes/no
    questions about training images it never trains on. The few-token phase goes on
    past its planned length, check by check, until the check reaches
    `base_check_accuracy`; at `base_few_tokens_max_steps` without that it raises
    `BaseComparisonStalled`.
    """
    parts = llava_parts(model)
    parts.vision_tower.requires_grad_(False)
    # dict.fromkeys: the LM head may be tied to the embeddings; optimise each tensor once.
    trainable = list(
        dict.fromkeys([*parts.projector.parameters(), *parts.language_model.parameters(), *parts.lm_head.parameters()])
    )
    attributes = image_attributes(samples)
    described = sorted(image_id for image_id, a in attributes.items() if a.shape or a.color)
    if recipe.base_check_images >= len(described):
        raise ValueError(
            f"base_check_images={recipe.base_check_images}: must be below the {len(described)} described "
            "training images, which the base also trains on"
        )
    held_out = set(random.Random(recipe.seed).sample(described, recipe.base_check_images))
    described = [image_id for image_id in described if image_id not in held_out]
    check_questions = own_wording_yes_no(
        [s for s in samples if s.image_id in held_out], attributes, recipe, random.Random(recipe.seed)
    )
    schedule = StageSchedule.with_decay_share(recipe.base_steps, recipe.lr_decay_share)
    # The few-token phase ends here (one more check interval each time the check fails at its end).
    few_tokens_end = round(recipe.base_few_tokens_share * recipe.base_steps)
    attempt = BaseAttempt(seed=seed)
    rng = random.Random(seed)

    def step_loss(step: int) -> torch.Tensor:
        few_tokens = step < few_tokens_end
        # Drawn only when the recipe interleaves, so a recipe without it builds as it always did.
        if not few_tokens and recipe.base_interleaved_share and rng.random() < recipe.base_interleaved_share:
            batch_size = max(1, recipe.base_batch_size // (recipe.base_interleaved_max_demos + 1))
            conversations = [interleaved_conversation(attributes, described, rng, recipe) for _ in range(batch_size)]
            visual = [
                [_random_token_subset(features[image_id], parts.config.image_seq_length, rng) for image_id, _, _ in turns[:-1]]
                + [features[turns[-1][0]]]
                for turns in conversations
            ]
            return _in_context_loss(
                model, tokenizer, visual, [[(q, a) for _, q, a in turns] for turns in conversations], recipe.instruction
            )
        max_tokens = recipe.base_few_tokens_max if few_tokens else parts.config.image_seq_length
        turns = 1 if few_tokens else recipe.base_all_tokens_turns
        image_ids = [rng.choice(described) for _ in range(recipe.base_batch_size // turns)]
        conversations = [distinct_instructions(attributes[image_id], turns, rng, recipe) for image_id in image_ids]
        return _lm_loss(
            model,
            tokenizer,
            [_random_token_subset(features[image_id], max_tokens, rng) for image_id in image_ids],
            conversations,
            recipe.instruction,
        )

    def check_comparison(steps_done: int) -> dict[str, str] | None:
        nonlocal few_tokens_end
        if steps_done > few_tokens_end or (steps_done % recipe.base_check_every and steps_done != few_tokens_end):
            return None
        accuracy = _yes_no_accuracy(model, tokenizer, features, check_questions, recipe, recipe.base_few_tokens_max)
        attempt.yes_no_checks[steps_done] = accuracy
        if attempt.learned_at_step is None and accuracy >= recipe.base_check_accuracy:
            attempt.learned_at_step = steps_done
        if attempt.learned_at_step is None and steps_done == few_tokens_end:
            if steps_done >= recipe.base_few_tokens_max_steps:
                raise BaseComparisonStalled(attempt, recipe)
            extension = min(recipe.base_check_every, recipe.base_few_tokens_max_steps - steps_done)
            few_tokens_end += extension
            schedule.constant_steps += extension
        return {"yes/no": f"{accuracy:.0%}"}

    model.train()
    attempt.final_loss = _optimise(
        trainable, lr=recipe.base_lr, schedule=schedule, step_loss=step_loss,
        description=f"stage 2/3 base (seed {seed})", progress=progress, after_step=check_comparison,
    )
    model.eval()
    attempt.few_token_steps = few_tokens_end
    attempt.final_yes_no = _yes_no_accuracy(model, tokenizer, features, check_questions, recipe, None)
    return attempt


def image_conversations(samples: Sequence[VQASample], max_turns: int, rng: random.Random) -> list[list[VQASample]]:
    """Each image's questions in shuffled order, split into near-equal conversations of at most `max_turns`."""
    by_image: dict[str, list[VQASample]] = {}
    for sample in samples:
        by_image.setdefault(sample.image_id, []).append(sample)
    conversations = []
    for image_id in sorted(by_image):
        questions = by_image[image_id]
        rng.shuffle(questions)
        count = math.ceil(len(questions) / max_turns)
        conversations += [questions[part::count] for part in range(count)]
    return conversations


def train_vqa_lora(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    samples: Sequence[VQASample],
    recipe: MiniRecipe,
    *,
    progress: bool = True,
) -> tuple[PeftModel, float]:
    """LoRA (rank from the recipe) on every decoder projection; everything else frozen.

    Trains on multi-turn conversations, one image with several of its questions: the
    cost is per token, and the image's visual tokens then serve every question in it.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        peft_model = apply_lora(model, rank=recipe.lora_rank)
    rng = random.Random(recipe.seed)
    conversations = image_conversations(samples, recipe.vqa_max_turns, rng)

    def visual_tokens(image_id: str) -> torch.Tensor:
        tokens = features[image_id]
        if rng.random() < recipe.vqa_random_keep_share:
            return _random_token_subset(tokens, tokens.shape[0], rng)
        return tokens

    def step_loss(_: int) -> torch.Tensor:
        batch = [rng.sample(c, len(c)) for c in rng.choices(conversations, k=recipe.vqa_batch_size)]
        return _lm_loss(
            peft_model,
            tokenizer,
            [visual_tokens(turns[0].image_id) for turns in batch],
            [[(sample.question, sample.answer) for sample in turns] for turns in batch],
            recipe.instruction,
        )

    peft_model.train()
    loss = _optimise(
        [p for p in peft_model.parameters() if p.requires_grad],
        lr=recipe.vqa_lr,
        schedule=StageSchedule.with_decay_share(recipe.vqa_steps, recipe.lr_decay_share),
        step_loss=step_loss,
        description="stage 3/3 VQA LoRA",
        progress=progress,
    )
    peft_model.eval()
    return peft_model, loss
