"""The mini model's training recipe: every number that decides what gets built.

The cache key is a fingerprint of this recipe, so changing any number builds a new
model instead of silently reusing an old one.
"""

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MiniRecipe:
    seed: int = 0
    # Every stage: warmup, a constant rate, then a cosine decay over this last share.
    lr_decay_share: float = 0.25
    # Stage 1, vision pretraining (stand-in for CLIP's): shape and colour from the
    # patch features LLaVA actually reads (the vision feature layer), so they carry both.
    vision_steps: int = 2000
    vision_batch_size: int = 64
    vision_lr: float = 3e-3
    vision_max_shift: int = 6
    # The same shape/colour loss on every patch token too, not only on their mean: the
    # base first learns from 1-4 tokens and pruning may keep any subset, so each token
    # must carry the whole image on its own, which a loss on the mean does not ask for
    # (results/mini_targets.md has the one-token probe per vision layer).
    vision_token_loss_weight: float = 1.0
    # Each patch token also names its own patch (a linear head over the N grid positions):
    # 0 leaves position to whatever the attribute losses keep, and they keep almost none
    # by the feature layer (the whole image on every token, under random shifts), whereas
    # CLIP's patch tokens keep it (seed 002, Fig. 2). A positive weight builds the mini
    # variant on which position-recovery attacks (SARA) and defenses against them can be
    # measured at all (`qpriv-privacy positions` probes what each layer keeps).
    vision_position_loss_weight: float = 0.0
    # Stage 2, the base: projector + decoder learn to describe images and answer
    # instructions generated from the captions (LLaVA's own way of making instruction
    # data), in wordings other than easy-VQA's and without negation.
    base_steps: int = 3500
    base_batch_size: int = 64
    base_lr: float = 1e-3
    # Comparing a named colour with the image's emerges far sooner when each sequence
    # holds only a few visual tokens (each carries the whole image): the first share of
    # the base stage keeps 1..few random tokens, the rest any number up to all of them.
    base_few_tokens_max: int = 4
    base_few_tokens_share: float = 0.75
    # After that, each image holds this many different instructions as one conversation
    # (batch = base_batch_size / turns images): 64 visual tokens then serve several
    # targets, and the cost is per token.
    base_all_tokens_turns: int = 4
    # A safety net for the comparison the base must learn (next comment): every
    # `base_check_every` steps the base answers yes/no in its own wordings about
    # `base_check_images` training images it never trains on; the few-token phase
    # (constant rate) goes on past its planned length, check by check, until the check
    # reaches `base_check_accuracy`; without that by `base_few_tokens_max_steps`, the
    # stage starts again from a fresh initialisation with the next seed, at most
    # `base_attempts` times in all. Without the check a base that never learned the
    # comparison would show only at the end, as a finished model answering yes/no no
    # better than the question alone predicts.
    base_check_every: int = 250
    base_check_images: int = 256
    base_check_accuracy: float = 0.9
    base_few_tokens_max_steps: int = 3500
    base_attempts: int = 3
    # Yes/no comparison is what is slow to learn (reading an attribute off is quick), so
    # each yes/no task is drawn this many times as often as a describe/which task.
    base_yes_no_weight: int = 6
    # Answering yes/no needs two things at the answer position: the attribute seen (the
    # "which" tasks teach reading it off the image) and the attribute the question names.
    # No other task teaches the latter, and neither alone predicts the answer (yes and no
    # are equally likely for every value), so learning both at once from yes/no alone is
    # slow, and when (or whether) it happens varies from seed to seed. Text-only "Repeat
    # the color: Is the shape red?" -> "red" (LLaVA-1.5's mix has text-only instructions
    # too) teaches reading the named attribute on its own, so the comparison emerges early.
    base_repeat_weight: int = 2
    # In-context learning (the mini-interleaved profile), which interleaved-data VLMs learn in
    # pretraining and a base of one-image conversations never does (it answers as well with
    # demonstrations as without): this share of the all-token steps are multi-image
    # conversations, 1..base_interleaved_max_demos demonstrations (image, question, answer) of
    # one task and then a target of the same task, learned on the target's answer. In
    # base_interleaved_hidden_share of them every turn asks the same uninformative question
    # (interleaved_hidden_questions), so only the demonstrations' answers say whether the
    # colour, the shape or a description is asked: a task read from the demonstrations, which
    # is what a new wording needs. Demonstrations keep 1..all of their visual tokens (as the
    # base's tail), the target all.
    base_interleaved_share: float = 0.0
    base_interleaved_max_demos: int = 4
    base_interleaved_hidden_share: float = 0.5
    interleaved_hidden_questions: tuple[str, ...] = ("What about this one?", "And this image?", "What is the answer here?")
    # The yes/no wordings per attribute, all positive: the LoRA stage is left negation and
    # easy-VQA's other phrasings. Several wordings tie the comparison to what a question
    # means rather than to one phrasing, so the LoRA stage can map easy-VQA's questions
    # onto it; "Is there a ...?" is VQAv2's commonest yes/no form, which LLaVA-1.5's
    # instruction mix contains, the others are paraphrases easy-VQA never uses.
    color_yes_no_wordings: tuple[str, ...] = (
        "Is the shape {}?", "Is there a {} shape?", "Can you see a {} shape?", "Does the picture show a {} shape?"
    )
    shape_yes_no_wordings: tuple[str, ...] = (
        "Is the shape a {}?", "Is there a {}?", "Can you see a {}?", "Does the picture show a {}?"
    )
    # Stage 3, the VQA stage: LoRA on the frozen base, the way every paradigm fine-tunes.
    # Multi-turn, as LLaVA-1.5 trains: each sequence is one image with up to
    # `vqa_max_turns` of its questions, so 64 visual tokens serve several answers (about
    # 30 tokens per question instead of 80): the cost is per token, and single-turn
    # sequences reach the same accuracy in several times the time. About two epochs:
    # fewer leave yes/no underfit, and twice this rate makes it collapse.
    vqa_steps: int = 1260
    # Conversations per step.
    vqa_batch_size: int = 12
    vqa_max_turns: int = 6
    vqa_lr: float = 1e-3
    # This share of conversations keeps a random 1..64 of the image's visual tokens
    # (log-uniform, as in the base's tail), the rest all 64: pruning hands the finished
    # model any count, and a LoRA stage that saw only all 64 answers unreliably at counts
    # it has not seen since the base.
    vqa_random_keep_share: float = 0.5
    lora_rank: int = 32
    # Every easy-VQA answer is one word; LLaVA's short-answer instruction would only
    # lengthen each sequence by a tenth.
    instruction: str | None = None

    def __post_init__(self) -> None:
        if self.base_all_tokens_turns < 1 or self.base_batch_size % self.base_all_tokens_turns:
            raise ValueError(
                f"base_all_tokens_turns={self.base_all_tokens_turns}: must be a positive divisor of "
                f"base_batch_size={self.base_batch_size}"
            )
        few_tokens_steps = round(self.base_few_tokens_share * self.base_steps)
        if self.base_check_every < 1:
            raise ValueError(f"base_check_every={self.base_check_every}: must be at least 1")
        if self.base_few_tokens_max_steps < few_tokens_steps:
            raise ValueError(
                f"base_few_tokens_max_steps={self.base_few_tokens_max_steps}: must be at least the "
                f"{few_tokens_steps} planned few-token steps (base_few_tokens_share x base_steps)"
            )
        if not 0.0 <= self.base_check_accuracy <= 1.0:
            raise ValueError(f"base_check_accuracy={self.base_check_accuracy}: must be within [0, 1]")
        if self.base_attempts < 1:
            raise ValueError(f"base_attempts={self.base_attempts}: must be at least 1")
        for name in ("vision_token_loss_weight", "vision_position_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        for name in ("base_interleaved_share", "base_interleaved_hidden_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be within [0, 1]")
        if self.base_interleaved_max_demos < 1:
            raise ValueError(f"base_interleaved_max_demos={self.base_interleaved_max_demos}: must be at least 1")
        if not 0.0 <= self.vqa_random_keep_share <= 1.0:
            raise ValueError(f"vqa_random_keep_share={self.vqa_random_keep_share}: must be within [0, 1]")
        if self.vqa_max_turns < 1:
            raise ValueError(f"vqa_max_turns={self.vqa_max_turns}: must be at least 1")

    def fingerprint(self) -> str:
        """The cache key. Fields added after the first builds count only when set away from
        their default, so every recipe built before they existed keeps its folder."""
        fields = {k: v for k, v in asdict(self).items() if not (k in _ADDED_LATER and v == _ADDED_LATER[k])}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


# Recipe fields added after the first builds, with the default that leaves a build as it was.
_ADDED_LATER = {
    "vision_position_loss_weight": 0.0,
    "base_interleaved_share": 0.0,
    "base_interleaved_max_demos": 4,
    "base_interleaved_hidden_share": 0.5,
    "interleaved_hidden_questions": ("What about this one?", "And this image?", "What is the answer here?"),
}


@dataclass(frozen=True)
class SceneRecipe:
    """The scene testbed's recipe (vlm/mini/scene_stages.py): every number that decides what
    the `mini-scenes` build makes; its fingerprint is the cache key, as MiniRecipe's."""

    dataset: str = "scenes-stamped"
    # The split every stage trains on. On the 3,000-image `train` split the 5,000-step base
    # answered its own training questions at 98.4% and the test questions at 79.8% (location
    # 97% vs 60%): it learned the images, not the rule that picks one object out of 64
    # tokens. The 20,000-image `pretrain` split shows each image about four times.
    train_split: str = "pretrain"
    seed: int = 0
    lr_decay_share: float = 0.25
    # The std of the projector's, the decoder's and the embeddings' initial weights. LLaMA's 0.02
    # is sized for 4,096-wide layers; at the mini's 128 it starts every attention logit near 0,
    # and a decoder picking the needed tokens out of the image stayed at the question-only
    # baseline for thousands of steps (on symbolic cells, "Is there a red circle?": 55% after
    # 2,000 steps at 0.02, 99% after 1,000 at 0.1). 0.1 is about 1/sqrt(128), the usual fan-in scale.
    decoder_init_std: float = 0.1
    # Stage 1: per-patch labels need no curriculum; the pixel read-out keeps what no label names.
    vision_steps: int = 1200
    vision_batch_size: int = 64
    vision_lr: float = 3e-3
    vision_position_loss_weight: float = 1.0
    vision_pixel_loss_weight: float = 1.0
    # Stage 2: per step, base_batch_size whole-image conversations of up to base_max_turns
    # questions and base_subset_batch_size single questions over the needed patches and a
    # random share of the rest. On `train`, 3,500 steps ended at 79.4% (loss 0.089) and 5,000
    # at 79.8% (0.026); the errors were the whole-image questions that must pick one object
    # out of 64 tokens (location, relation), which the needed-patch subsets answer at 98%.
    base_steps: int = 5000
    base_batch_size: int = 16
    base_subset_batch_size: int = 16
    base_max_turns: int = 6
    base_lr: float = 1e-3
    # Stage 3: LoRA over the same mixture.
    vqa_steps: int = 400
    vqa_lr: float = 1e-3
    lora_rank: int = 32
    # Scene answers are one word, as easy-VQA's.
    instruction: str | None = None
    # Torch threads of the build: CPU kernels reduce in an order that depends on the thread
    # count, so a fixed count is what makes two builds of one recipe bit-identical. One: a
    # 2-thread build slowed ~10x whenever another job held a core (its threads wait on each
    # other at every kernel), where one thread keeps its pace and leaves the other core free.
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("vision_steps", "base_steps", "vqa_steps", "vision_batch_size", "base_max_turns", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not self.decoder_init_std > 0:
            raise ValueError(f"decoder_init_std={self.decoder_init_std}: must be a positive standard deviation")
        if self.base_batch_size + self.base_subset_batch_size < 1:
            raise ValueError("base_batch_size + base_subset_batch_size must be at least 1")

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps({"kind": "scenes", **asdict(self)}, sort_keys=True).encode()).hexdigest()[:12]


# The recipe each mini profile is built with (vlm/profiles.py registers the profiles).
RECIPES = {
    "mini": MiniRecipe(),
    "mini-positional": MiniRecipe(vision_position_loss_weight=1.0),
    # A longer all-token tail (2,375 steps, half of them interleaved) gives in-context learning
    # its own steps without shortening the few-token phase that seed 0 needed (2,625 steps).
    "mini-interleaved": MiniRecipe(base_interleaved_share=0.5, base_steps=5000, base_few_tokens_share=0.525),
    "mini-scenes": SceneRecipe(),
}


def recipe_for(profile: str) -> "MiniRecipe | SceneRecipe":
    try:
        return RECIPES[profile]
    except KeyError:
        raise ValueError(f"no mini recipe for profile {profile!r}; mini profiles: {', '.join(RECIPES)}") from None
