"""Task vectors (seed 003's MTV): attention heads' outputs at a prompt's last token, read over
many-shot chunks, averaged, and written back in place of the demonstrations at inference.

MTV (Huang et al., 2024) takes a head's activation before the attention's output projection:
for Llama, the input of `self_attn.o_proj`, the heads' outputs side by side. A chunk is one
multi-image prompt of K demonstrations (image, question, answer) and a target (image,
question); the activations at its last token, averaged over chunks, are the task vector. A
query then runs with no demonstrations, and the selected heads' outputs at its last token are
replaced by the task vector's.

Where the method leaves a choice open, this module makes it (and says so in the report):
- Replacement happens at the query's last prompt token, whose output is the first answer
  token, and only there (replaced_heads).
- REINFORCE's reward is the log-likelihood of the answer's first token at the query's last
  position (MTV: the model's loss on the answer), averaged over a batch of public queries,
  against the batch's mean reward as baseline.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from vlm.answering import encode_prompts
from vlm.features import VisionFeatureCache
from vlm.profiles import Profile
from vlm.segments import llava_parts, merge_multimodal_inputs, project_visual_features, run_decoder_layers
from vqa import VQASample


@dataclass(frozen=True)
class HeadLayout:
    """Which decoder layers' heads a task vector covers, and each head's width."""

    layers: tuple[int, ...]
    heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """A task vector's shape: [layers, heads, head_dim]."""
        return (len(self.layers), self.heads, self.head_dim)

    @property
    def numel(self) -> int:
        return len(self.layers) * self.heads * self.head_dim


def head_layout(model: nn.Module, layers: Sequence[int] | None = None) -> HeadLayout:
    """The layout of `layers` (default: every decoder layer), checked against the model."""
    parts = llava_parts(model)
    return _layout(parts.language_model.config.to_dict(), parts.num_layers, layers)


def profile_head_layout(profile: Profile, layers: Sequence[int] | None = None) -> HeadLayout:
    """The same from a profile, without building its model (what a server checks shares against)."""
    return _layout(dict(profile.text), profile.num_layers, layers)


def _layout(text_config: dict, num_layers: int, layers: Sequence[int] | None) -> HeadLayout:
    chosen = tuple(range(num_layers)) if layers is None else tuple(layers)
    if not chosen or sorted(set(chosen)) != list(chosen) or not all(0 <= layer < num_layers for layer in chosen):
        raise ValueError(f"layers={list(chosen)}: need distinct, increasing decoder layers in [0, {num_layers})")
    heads = text_config["num_attention_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // heads
    return HeadLayout(chosen, heads, head_dim)


def _output_projections(model: nn.Module, layout: HeadLayout) -> list[nn.Module]:
    layers = llava_parts(model).language_model.layers
    return [layers[index].self_attn.o_proj for index in layout.layers]


@dataclass
class LastTokenHeads:
    """Reads, on every forward while entered, each layout layer's head outputs at the last
    column ([B, layers, heads, head_dim]); left-padded batches put every sample's last token there."""

    model: nn.Module
    layout: HeadLayout
    _latest: dict[int, torch.Tensor] = field(default_factory=dict)
    _hooks: list = field(default_factory=list)

    def __enter__(self) -> "LastTokenHeads":
        for slot, projection in enumerate(_output_projections(self.model, self.layout)):
            self._hooks.append(projection.register_forward_pre_hook(self._reader(slot)))
        return self

    def __exit__(self, *_: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _reader(self, slot: int):
        def read(_: nn.Module, args: tuple) -> None:
            last = args[0][:, -1]
            self._latest[slot] = last.detach().reshape(last.shape[0], self.layout.heads, self.layout.head_dim)

        return read

    def activations(self) -> torch.Tensor:
        missing = [self.layout.layers[slot] for slot in range(len(self.layout.layers)) if slot not in self._latest]
        if missing:
            raise RuntimeError(f"no forward has reached decoder layers {missing} since the reader was entered")
        return torch.stack([self._latest[slot] for slot in range(len(self.layout.layers))], dim=1)


@contextmanager
def replaced_heads(model: nn.Module, layout: HeadLayout, values: torch.Tensor, mask: torch.Tensor) -> Iterator[None]:
    """While inside, each sample's query token carries `values` [layers, heads, head_dim] in the
    heads `mask` [layers, heads] selects; every other head and token is untouched.

    The query token is each sample's last token in the first forward inside the context (the
    prompt's last, whose output is the first answer token), and it stays replaced in every later
    forward, found by its position id: greedy generation reruns the sequence with the answer so
    far appended, and MTV's cached generation keeps the prompt's replaced keys and values. Enter
    one context per batch of prompts (vlm.answering's `intervention`).
    """
    if tuple(values.shape) != layout.shape or tuple(mask.shape) != layout.shape[:2]:
        raise ValueError(
            f"task vector of shape {tuple(values.shape)} and mask of shape {tuple(mask.shape)}; the layout needs "
            f"{layout.shape} and {layout.shape[:2]}"
        )
    mask = mask.bool()
    query: dict[str, torch.Tensor] = {}

    def find_query(_: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError("replaced_heads needs the decoder layers called with position_ids (vlm.segments passes them)")
        if "position" not in query:
            query["position"] = positions[:, -1].clone()
        query["rows"] = positions == query["position"].to(positions.device)[:, None]

    def writer(slot: int):
        selected, value = mask[slot], values[slot]

        def write(_: nn.Module, args: tuple) -> tuple:
            hidden = args[0]
            heads = hidden.reshape(*hidden.shape[:2], layout.heads, layout.head_dim)
            where = query["rows"][:, :, None, None] & selected.to(hidden.device)[None, None, :, None]
            heads = torch.where(where, value.to(hidden.device, hidden.dtype)[None, None], heads)
            return (heads.reshape(hidden.shape), *args[1:])

        return write

    decoder_layers = llava_parts(model).language_model.layers
    hooks = []
    for slot, (layer, projection) in enumerate(zip(layout.layers, _output_projections(model, layout), strict=True)):
        if mask[slot].any():
            hooks.append(decoder_layers[layer].register_forward_pre_hook(find_query, with_kwargs=True))
            hooks.append(projection.register_forward_pre_hook(writer(slot)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def in_context_inputs(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    targets: Sequence[VQASample],
    demonstrations: Sequence[Sequence[VQASample]],
    instruction: str | None,
):
    """Left-padded decoder inputs of each target after its demonstrations (vlm.answering's prompts)."""
    prompts = encode_prompts(tokenizer, targets, instruction, demonstrations)
    device = llava_parts(model).lm_head.weight.device
    visual = [[project_visual_features(model, features[s.image_id].to(device)) for s in [*demos, target]]
              for target, demos in zip(targets, demonstrations, strict=True)]
    return merge_multimodal_inputs(model, prompts, visual)


@torch.no_grad()
def chunk_activations(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    chunks: Sequence[Sequence[VQASample]],
    layout: HeadLayout,
    *,
    instruction: str | None,
    batch_size: int = 16,
    progress: bool = True,
) -> torch.Tensor:
    """[chunks, layers, heads, head_dim]: each chunk's head outputs at its last token (the
    target's answer position); a chunk is its demonstrations followed by its target."""
    was_training = model.training
    model.eval()
    num_layers = max(layout.layers) + 1
    outputs = []
    with LastTokenHeads(model, layout) as reader:
        for start in tqdm(range(0, len(chunks), batch_size), desc="task-vector chunks", unit="batch",
                          disable=not progress):
            batch = chunks[start : start + batch_size]
            inputs = in_context_inputs(model, tokenizer, features, [c[-1] for c in batch], [c[:-1] for c in batch],
                                    instruction)
            run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0, num_layers)
            outputs.append(reader.activations())
    model.train(was_training)
    return torch.cat(outputs)


class FirstAnswerToken:
    """Zero-shot prompts of `samples`, built once, and the log-likelihood of each answer's first
    token at the prompt's last column, computed again under each head replacement tried."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, features: VisionFeatureCache,
                 samples: Sequence[VQASample], *, instruction: str | None) -> None:
        self.model = model
        self.inputs = in_context_inputs(model, tokenizer, features, samples, [()] * len(samples), instruction)
        self.tokens = torch.tensor(
            [tokenizer(" " + sample.answer.strip(), add_special_tokens=False)["input_ids"][0] for sample in samples]
        )

    def log_likelihood(self) -> torch.Tensor:
        """[B]: log p(first token of each sample's answer | its zero-shot prompt)."""
        inputs = self.inputs
        logits = run_decoder_layers(
            self.model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
            llava_parts(self.model).num_layers, apply_head=True,
        )[:, -1].float()
        return logits.log_softmax(-1).gather(1, self.tokens[:, None].to(logits.device)).squeeze(1)


@dataclass(frozen=True)
class ReinforceSettings:
    """MTV's head selection: a Bernoulli logit per head, trained by REINFORCE on public queries."""

    # Adam steps, each on `batch_size` public queries drawn afresh.
    steps: int = 100
    batch_size: int = 16
    # Masks sampled per step; each is scored on the step's queries, their mean reward is the baseline.
    samples_per_step: int = 8
    lr: float = 0.1
    # The logits' start: sigmoid(-1) = 27% of heads on in a first sampled mask.
    initial_logit: float = -1.0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "samples_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: must be > 0")


def reinforce_head_mask(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    features: VisionFeatureCache,
    queries: Sequence[VQASample],
    layout: HeadLayout,
    values: torch.Tensor,
    settings: ReinforceSettings,
    *,
    instruction: str | None,
    generator: torch.Generator,
    progress: bool = True,
) -> tuple[torch.Tensor, list[float]]:
    """The head mask [layers, heads] (logit > 0) REINFORCE learns on `queries`, and the mean
    reward of each step's sampled masks."""
    settings.validate()
    logits = torch.full(layout.shape[:2], settings.initial_logit, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=settings.lr)
    rewards_per_step = []
    was_training = model.training
    model.eval()
    for _ in tqdm(range(settings.steps), desc="head selection (REINFORCE)", unit="step", disable=not progress):
        picks = torch.randint(len(queries), (settings.batch_size,), generator=generator).tolist()
        probabilities = torch.sigmoid(logits)
        masks = torch.bernoulli(probabilities.detach().expand(settings.samples_per_step, -1, -1), generator=generator)
        rewards = []
        with torch.no_grad():
            answers = FirstAnswerToken(model, tokenizer, features, [queries[index] for index in picks],
                                       instruction=instruction)
            for mask in masks:
                with replaced_heads(model, layout, values, mask):
                    rewards.append(answers.log_likelihood().mean())
        rewards = torch.stack(rewards)
        advantage = rewards - rewards.mean()
        log_prob = torch.distributions.Bernoulli(probs=probabilities).log_prob(masks).sum(dim=(1, 2))
        loss = -(advantage * log_prob).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rewards_per_step.append(float(rewards.mean()))
    model.train(was_training)
    return (logits.detach() > 0), rewards_per_step
