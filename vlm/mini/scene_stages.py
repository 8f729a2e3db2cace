"""The stages that build the scene testbed's mini model (`mini-scenes`, vqa.scenes).

1. Vision: the tower's patch rows are local by construction (vlm.segments.local_attention_mask),
   so each row is taught what its own patch shows: the colour, shape and size of the object
   covering most of it (or none), its position on the grid, and its pixels (a linear read-out
   of the patch, so what no label names, such as a stamped digit's strokes, stays in the row
   as it stays in CLIP's).
2. Base: projector + decoder answer the scene questions of the training split, as multi-turn
   conversations over all tokens and as single questions over the patches the question needs
   plus a random share of the rest, so the model answers from any keep set that holds what
   the question needs (pruning hands it such sets) and from the whole image.
3. VQA: LoRA on the frozen base over the same mixture, the way every paradigm fine-tunes.

The easy-VQA mini needs a staged curriculum (vlm/mini/stages.py) because its questions only
make sense of a whole-image summary; here each question is about objects the rows describe
directly, and the decoder learns the questions from the labels alone.
"""

import math
import random
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from vlm.features import VisionFeatureCache
from vlm.lora import apply_lora
from vlm.mini.recipe import SceneRecipe
from vlm.mini.stages import StageSchedule, _lm_loss, _optimise, image_conversations
from vlm.segments import llava_parts, vision_features
from vqa import VQASample, needed_patches
from vqa.scenes import Scene, SceneSpec


def patch_labels(scenes: Sequence[Scene], spec: SceneSpec, patch_size: int) -> dict[str, torch.Tensor]:
    """Per scene and patch: the colour, shape and size index of the object covering most of the
    patch, the last index of each attribute meaning no object; [scenes, N] each."""
    grid = spec.image_size // patch_size
    labels = {name: torch.full((len(scenes), grid * grid), len(values), dtype=torch.long)
              for name, values in (("color", spec.colors), ("shape", spec.shapes), ("size", spec.sizes))}
    for index, scene in enumerate(scenes):
        best = torch.zeros(grid * grid)
        for obj in scene.objects:
            left, top, right, bottom = obj.box
            for patch in range(grid * grid):
                row, col = divmod(patch, grid)
                width = min(right, (col + 1) * patch_size) - max(left, col * patch_size)
                height = min(bottom, (row + 1) * patch_size) - max(top, row * patch_size)
                area = max(0, width) * max(0, height)
                if area > best[patch]:
                    best[patch] = area
                    labels["color"][index, patch] = spec.colors.index(obj.color)
                    labels["shape"][index, patch] = spec.shapes.index(obj.shape)
                    labels["size"][index, patch] = spec.sizes.index(obj.size)
    return labels


def pretrain_scene_vision(
    model: nn.Module,
    pixel_values: torch.Tensor,
    labels: dict[str, torch.Tensor],
    spec: SceneSpec,
    recipe: SceneRecipe,
    *,
    progress: bool = True,
) -> float:
    """Train the (local) vision tower on each patch row's own labels, position and pixels."""
    parts = llava_parts(model)
    vision = parts.config.vision_config
    width, patch = vision.hidden_size, vision.patch_size
    generator = torch.Generator().manual_seed(recipe.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        heads = nn.ModuleDict({
            "color": nn.Linear(width, len(spec.colors) + 1),
            "shape": nn.Linear(width, len(spec.shapes) + 1),
            "size": nn.Linear(width, len(spec.sizes) + 1),
            "position": nn.Linear(width, (vision.image_size // patch) ** 2),
            "pixels": nn.Linear(width, 3 * patch * patch),
        })
    parts.vision_tower.train()

    def step_loss(_: int) -> torch.Tensor:
        index = torch.randint(len(pixel_values), (recipe.vision_batch_size,), generator=generator)
        pixels = pixel_values[index]
        rows = vision_features(model, pixels)  # [B, N, width]
        flat = rows.flatten(0, 1)
        loss = sum(F.cross_entropy(heads[name](flat), labels[name][index].flatten()) for name in ("color", "shape", "size"))
        positions = torch.arange(rows.shape[1]).repeat(rows.shape[0])
        loss = loss + recipe.vision_position_loss_weight * F.cross_entropy(heads["position"](flat), positions)
        target = F.unfold(pixels, patch, stride=patch).transpose(1, 2).flatten(0, 1)  # [B*N, 3*p*p]
        return loss + recipe.vision_pixel_loss_weight * F.mse_loss(heads["pixels"](flat), target)

    loss = _optimise(
        [*parts.vision_tower.parameters(), *heads.parameters()],
        lr=recipe.vision_lr,
        schedule=StageSchedule.with_decay_share(recipe.vision_steps, recipe.lr_decay_share),
        step_loss=step_loss,
        description="stage 1/3 vision (scenes)",
        progress=progress,
    )
    parts.vision_tower.eval()
    return loss


def keep_needed(sample: VQASample, tokens: torch.Tensor, image_size: int, patch_size: int,
                rng: random.Random) -> torch.Tensor:
    """The patches `sample` needs plus a log-uniform random number of the others, in grid order
    (scenes are generated at the model's image size, so their boxes are in its pixels)."""
    count = tokens.shape[0]
    needed = set(needed_patches(sample.needed_boxes, image_size, image_size, patch_size))
    others = [patch for patch in range(count) if patch not in needed]
    extra = round(math.exp(rng.uniform(0.0, math.log(len(others) + 1)))) - 1
    kept = sorted(needed | set(rng.sample(others, extra)))
    if not kept:  # nothing needed and no extra drawn: one random patch, as a keep set is never empty
        kept = [rng.randrange(count)]
    return tokens[kept]


def _mixture_loss(
    model: nn.Module,
    tokenizer,
    features: VisionFeatureCache,
    conversations: Sequence[Sequence[VQASample]],
    singles: Sequence[VQASample],
    recipe: SceneRecipe,
    image_size: int,
    patch_size: int,
    rng: random.Random,
) -> torch.Tensor:
    batch = [rng.sample(c, len(c)) for c in rng.choices(conversations, k=recipe.base_batch_size)]
    picked = rng.choices(singles, k=recipe.base_subset_batch_size)
    visual = [features[turns[0].image_id] for turns in batch]
    visual += [keep_needed(s, features[s.image_id], image_size, patch_size, rng) for s in picked]
    turns = [[(s.question, s.answer) for s in conversation] for conversation in batch]
    turns += [[(s.question, s.answer)] for s in picked]
    return _lm_loss(model, tokenizer, visual, turns, recipe.instruction)


def train_scene_decoder(
    model: nn.Module,
    tokenizer,
    features: VisionFeatureCache,
    samples: Sequence[VQASample],
    recipe: SceneRecipe,
    *,
    stage: str,
    progress: bool = True,
) -> tuple[nn.Module, float]:
    """Stage "base" trains projector + decoder + embeddings; stage "vqa" trains LoRA on the frozen base.
    Returns the trained model (peft-wrapped for "vqa") and its last loss."""
    parts = llava_parts(model)
    vision = parts.config.vision_config
    rng = random.Random(recipe.seed + (0 if stage == "base" else 1))
    conversations = image_conversations(samples, recipe.base_max_turns, rng)
    singles = list(samples)
    if stage == "base":
        parts.vision_tower.requires_grad_(False)
        trained = model
        parameters = list(dict.fromkeys(
            [*parts.projector.parameters(), *parts.language_model.parameters(), *parts.lm_head.parameters()]))
        steps, lr = recipe.base_steps, recipe.base_lr
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            trained = apply_lora(model, rank=recipe.lora_rank)
        parameters = [p for p in trained.parameters() if p.requires_grad]
        steps, lr = recipe.vqa_steps, recipe.vqa_lr

    def step_loss(_: int) -> torch.Tensor:
        return _mixture_loss(trained, tokenizer, features, conversations, singles, recipe,
                             vision.image_size, vision.patch_size, rng)

    trained.train()
    loss = _optimise(
        parameters, lr=lr, schedule=StageSchedule.with_decay_share(steps, recipe.lr_decay_share),
        step_loss=step_loss, description=f"stage {2 if stage == 'base' else 3}/3 {stage} (scenes)", progress=progress,
    )
    trained.eval()
    return trained, loss

