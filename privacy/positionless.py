"""The positionless edge (seed 002's defense): a vision tower without positional embeddings,
distilled back to the original model block by block.

Without the positional embeddings nothing in a patch's row says where the patch was, so a
position attack (SARA's TPP) has nothing to read; the model loses what the positions told
it, and distillation gives that back where it can: for block j = 1..k, only block j of the
client's vision tower trains to minimise T²·KL(softmax(teacher/T) ‖ softmax(student/T)) over
the answer tokens' logits (T = 4, Adam at lr 1e-4), the teacher being the original model and
everything but block j frozen. The adversarial variant (`position_weight` λ > 0) alternates
an auxiliary position predictor (a two-layer MLP on the tower's output rows) minimising its
cross-entropy with the edge minimising L_KD − λ·L_pos, so the edge also unlearns the position
that its attention can rebuild from the image's content.

`distill_positionless` does the training on tensors; `qpriv-privacy positionless` (sims/)
builds the data, caches each block's result and writes the artefact: a folder holding the
defended tower's weights (`tower.pt`) and `manifest.json`. The run config selects it as the
EDGE defense `positionless` (`privacy.positionless.artifact`). QPriv-VL still scores patches
on the undefended tower's cached features; only the rows that leave come from this tower.
"""

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from privacy.base import Defended, DefenseSeed, OptionError, register_defense
from privacy.edge import EdgeDefense, EdgeTokens
from vlm.segments import (
    IGNORE_INDEX,
    llava_parts,
    merge_multimodal_inputs,
    project_visual_features,
    run_decoder_layers,
    vision_hidden_states,
)

TOWER_FILE, MANIFEST_FILE = "tower.pt", "manifest.json"


@dataclass
class DistillSettings:
    # k: vision blocks distilled one after another, from the first.
    blocks: int = 1
    # Adam steps per block, on minibatches of `batch_size` training rows.
    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-4
    temperature: float = 4.0
    # λ_pos of the adversarial variant (0: plain distillation), and its position predictor's rate.
    position_weight: float = 0.0
    position_lr: float = 1e-3
    seed: int = 0

    def validate(self, vision_blocks: int) -> None:
        if not 1 <= self.blocks <= vision_blocks:
            raise OptionError("blocks", self.blocks, f"1..{vision_blocks} (the vision blocks that run)")
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise OptionError(name, getattr(self, name), "an integer >= 1")
        for name in ("lr", "temperature", "position_lr"):
            if not getattr(self, name) > 0:
                raise OptionError(name, getattr(self, name), "> 0")
        if self.position_weight < 0:
            raise OptionError("position_weight", self.position_weight, ">= 0")


def positionless_tower(tower: nn.Module) -> nn.Module:
    """A copy of a CLIP vision tower whose positional embeddings are zero (removed)."""
    student = copy.deepcopy(tower)
    with torch.no_grad():
        student.embeddings.position_embedding.weight.zero_()
    student.embeddings.position_embedding.weight.requires_grad_(False)
    return student


@dataclass(frozen=True)
class DistillBatch:
    """Training rows as the model reads them: images, prompts (with the image placeholder) and answers."""

    pixel_values: torch.Tensor
    prompt_ids: list[torch.Tensor]
    answer_ids: list[torch.Tensor]

    def __len__(self) -> int:
        return self.pixel_values.shape[0]

    def take(self, index: torch.Tensor) -> "DistillBatch":
        return DistillBatch(self.pixel_values[index], [self.prompt_ids[i] for i in index.tolist()],
                            [self.answer_ids[i] for i in index.tolist()])


def _device(model: nn.Module) -> torch.device:
    return llava_parts(model).lm_head.weight.device


def answer_logits(model: nn.Module, features: torch.Tensor, batch: DistillBatch) -> torch.Tensor:
    """The logits that predict each answer token [M, V], given every patch's features [B, N, Dv]."""
    visual = project_visual_features(model, features.to(llava_parts(model).lm_head.weight.dtype))
    inputs = merge_multimodal_inputs(model, batch.prompt_ids, list(visual), batch.answer_ids)
    logits = run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                                llava_parts(model).num_layers, apply_head=True)
    labelled = inputs.labels[:, 1:] != IGNORE_INDEX
    return logits[:, :-1][labelled].float()


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T²·KL(softmax(teacher/T) ‖ softmax(student/T)), averaged over the answer tokens."""
    return F.kl_div(F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1),
                    log_target=True, reduction="batchmean") * temperature**2


@torch.no_grad()
def held_out_kl(model: nn.Module, tower: nn.Module, batch: DistillBatch, temperature: float, chunk: int = 32) -> float:
    """The distillation loss of `tower` against the model's own on `batch` (no training)."""
    total, count = 0.0, 0
    for start in range(0, len(batch), chunk):
        part = batch.take(torch.arange(start, min(start + chunk, len(batch))))
        teacher = answer_logits(model, vision_hidden_states(model, part.pixel_values.to(_device(model)))[-1], part)
        student = answer_logits(model, vision_hidden_states(model, part.pixel_values.to(_device(model)), tower)[-1], part)
        total += float(distillation_loss(student, teacher, temperature)) * teacher.shape[0]
        count += teacher.shape[0]
    return total / count


def _position_head(width: int, patches: int, seed: int) -> nn.Module:
    """The adversarial variant's position predictor, initialised from `seed` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, patches))


def distill_block(model: nn.Module, tower: nn.Module, block: int, train: DistillBatch, settings: DistillSettings,
                  progress: Callable[[dict[str, float]], None] = lambda metrics: None) -> dict[str, float]:
    """Train block `block` (1-based) of `tower` in place against the model's own tower; the
    rest of the tower and the model stay as they are (the block is frozen again after).
    Returns the last step's losses (and, adversarial, the position predictor's accuracy)."""
    layer = tower.encoder.layers[block - 1].requires_grad_(True)
    params = list(layer.parameters())
    optimizer = torch.optim.Adam(params, lr=settings.lr)
    device = _device(model)
    patches = tower.embeddings.num_patches
    head = optimizer_head = None
    if settings.position_weight > 0:
        head = _position_head(tower.config.hidden_size, patches, settings.seed + block).to(device)
        optimizer_head = torch.optim.Adam(head.parameters(), lr=settings.position_lr)
    generator = torch.Generator().manual_seed(settings.seed * 1_000 + block)
    targets = torch.arange(patches, device=device)
    metrics: dict[str, float] = {}
    for _ in range(settings.steps):
        part = train.take(torch.randperm(len(train), generator=generator)[: settings.batch_size])
        pixels = part.pixel_values.to(device)
        with torch.no_grad():
            teacher = answer_logits(model, vision_hidden_states(model, pixels)[-1], part)
        features = vision_hidden_states(model, pixels, tower)[-1]
        loss = distillation_loss(answer_logits(model, features, part), teacher, settings.temperature)
        metrics = {"kd": float(loss.detach())}
        if head is not None:
            position_loss = F.cross_entropy(head(features.detach().float()).flatten(0, 1),
                                            targets.repeat(features.shape[0]))
            optimizer_head.zero_grad(set_to_none=True)
            position_loss.backward()
            optimizer_head.step()
            adversary = F.cross_entropy(head(features.float()).flatten(0, 1), targets.repeat(features.shape[0]))
            loss = loss - settings.position_weight * adversary
            metrics["position_loss"] = float(adversary.detach())
        grads = torch.autograd.grad(loss, params)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress(metrics)
    layer.requires_grad_(False)
    if head is not None:
        with torch.no_grad():
            logits = head(vision_hidden_states(model, train.pixel_values[:64].to(device), tower)[-1].float())
            metrics["position_accuracy"] = float((logits.argmax(-1) == targets).float().mean())
    return metrics


def settings_fingerprint(settings: DistillSettings, profile: str, stage: str, rows: int, dataset: str = "easyvqa") -> str:
    """What block j's result depends on: every setting but k (so k = 2 reuses k = 1's first block).
    The dataset enters only away from easy-VQA, so edges prepared before it was a setting keep their key."""
    chosen = {k: v for k, v in asdict(settings).items() if k != "blocks"}
    fields = {"settings": chosen, "profile": profile, "stage": stage, "rows": rows}
    key = json.dumps(fields | ({"dataset": dataset} if dataset != "easyvqa" else {}), sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class PositionlessOptions:
    # A folder `qpriv-privacy positionless` wrote (tower.pt, manifest.json).
    artifact: str = ""

    def validate(self) -> None:
        if self.artifact and not (Path(self.artifact).expanduser() / MANIFEST_FILE).exists():
            raise OptionError("artifact", self.artifact, f"a folder holding {MANIFEST_FILE} and {TOWER_FILE}, "
                              "written by `qpriv-privacy positionless`")


class PositionlessEdge(EdgeDefense):
    name = "positionless"
    Options = PositionlessOptions
    # How well it hides positions was fixed when its tower was distilled (`qpriv-privacy positionless`).
    strength = None

    def __init__(self, options: PositionlessOptions | None = None) -> None:
        super().__init__(options)
        self._tower: nn.Module | None = None

    def check(self, patches: int, blocks: int) -> None:
        if not self.options.artifact:
            raise OptionError("artifact", "", "the folder `qpriv-privacy positionless --profile ... --out DIR` wrote")
        manifest = json.loads((Path(self.options.artifact).expanduser() / MANIFEST_FILE).read_text())
        if manifest["num_patches"] != patches:
            raise OptionError("artifact", self.options.artifact,
                              f"an edge of this profile ({patches} patches; this one was built for "
                              f"{manifest['profile']}, {manifest['num_patches']})")

    def vision_tower(self, tower: nn.Module) -> nn.Module:
        if self._tower is None:
            defended = copy.deepcopy(tower)
            state = torch.load(Path(self.options.artifact).expanduser() / TOWER_FILE, weights_only=True)
            defended.load_state_dict(state)
            self._tower = defended.requires_grad_(False).eval()
        return self._tower

    def apply(self, payload: EdgeTokens, seed: DefenseSeed) -> Defended[EdgeTokens]:
        # The defense is the tower itself: nothing changes between its blocks.
        return Defended(payload)


register_defense(PositionlessEdge)

