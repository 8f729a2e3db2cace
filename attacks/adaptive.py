"""The adaptive attacker's copy of the run's defense (Kerckhoffs: it knows the defense and its options).

FORA's and FSHA's adaptive variants (`adaptive=True`) train their inverse network on
auxiliary rows passed through the same activation-stage defenses the clients apply
(privacy/: noise, sparsification, PriPert), so the decoder learns to invert defended
rows rather than clean ones. `AttackerDefense` is that copy: the run's ACTIVATION
defenses with the run's options, drawing its random numbers from the attacker's own
seed (it cannot know the clients' privacy seed), applied to the visual rows the
attacker's own front (substitute, pilot) computes for its auxiliary images.

Where this differs from the client's own application: the attacker has only the
visual rows of each auxiliary image (attacks.knowledge.visual_rows), not the text
tokens around them, so each auxiliary sample is defended as one sample of its visual
rows alone (lengths = rows per sample). Per-sample quantities are therefore taken
over the visual rows only — sparsification's exact zero share, PriPert's direction
(its Jacobian is that of the visual inputs -> visual rows map, with the template's
prefix fixed in front, where the client's covers the whole prompt: prefix, visual
and text rows), PriPert-L2's budget relative to the visual rows' norm. Noise is the
same per element either way. LOSS-stage defenses (NoPeek) change how the client
trains, not what it sends, and have no counterpart here.

`AttackerEdge` is the same for the EDGE-stage defenses (token shuffling, merging and
dropping inside the client's vision tower, the positionless tower): the attacker runs its
own copy of the edge on its auxiliary images, with the run's options and its own seed, and
gets the rows on the patch grid with the positions a client would send. The positionless
edge's copy is the run's own distilled tower: the strongest attacker, one that holds the
defended weights, not only the method.

`AdaptiveAttack` is what FORA, SARA and the cut probe share: `adaptive=True` takes the run's
defenses (`prepare_replay`, or the recording's header) and `attacker_rows` computes the
attacker's visual rows through both copies, the edge first, as a client's rows pass them;
`policy_view` prunes the attacker's images as the run's pruning policy would.

Where the run's defenses come from (`defenses_for_run`): the run's config (what
`prepare_replay` is handed), else the recording header's description of them.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from attacks.base import Attack
from attacks.context import ReplayContext
from attacks.knowledge import AttackerKnowledge, visual_rows
from attacks.recording import Recording
from config import SimConfig
from privacy import ACTIVATION, EDGE, DefenseChain, Payload, defense_class, options_from
from privacy.edge import EdgeOutput, edge_grid, edge_vision_tokens, select_sent
from training.defenses import build_defenses
from training.selector import build_selector
from vlm.segments import llava_parts, project_visual_features, run_decoder_layers
from vqa import VQASample


def chain_from_description(description: Sequence[Mapping[str, Any]]) -> DefenseChain:
    """A chain from its `describe()` (the recording header's "defenses")."""
    names = [entry["name"] for entry in description]
    options = {entry["name"]: options_from(defense_class(entry["name"]), entry.get("options", {}))
               for entry in description}
    return DefenseChain.build(names, options)


def defenses_for_run(attack: str, config: SimConfig | None, recording: Recording | None = None) -> DefenseChain:
    """The run's defenses: from its config, else from the recording's header; raises when neither says."""
    if config is not None:
        return build_defenses(config)
    if recording is not None and "defenses" in recording.header:
        return chain_from_description(recording.header["defenses"])
    raise ValueError(
        f"{attack} with adaptive=True re-applies the run's defenses: replay it on a run folder "
        "(prepare_replay hands it the run's config) or on a recording whose header describes them"
    )


class AttackerDefense:
    """The run's ACTIVATION-stage defenses as the attacker applies them to its own visual rows."""

    def __init__(self, knowledge: AttackerKnowledge, chain: DefenseChain, seed: int) -> None:
        self.knowledge = knowledge
        self.chain = DefenseChain(chain.at(ACTIVATION), seed=seed)
        # Every call draws anew (its own step), from the attacker's seed.
        self.calls = 0

    @property
    def names(self) -> list[str]:
        return self.chain.names

    def visual_rows(
        self, model: nn.Module, features: torch.Tensor, keep: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """`attacks.knowledge.visual_rows` (the same rows, differentiable in the model's parameters)
        then the defenses, each image's visual rows one sample; [k_b, D] each."""
        k = self.knowledge
        batch = features.shape[0]
        keep = [torch.arange(features.shape[1])] * batch if keep is None else list(keep)
        if len(keep) != batch:
            raise ValueError(f"got {len(keep)} keep sets for {batch} images")
        weight = llava_parts(model).lm_head.weight
        inputs: list[torch.Tensor | None] = [None] * batch
        for members in _by_size([int(indices.numel()) for indices in keep]).values():
            chosen = torch.stack([features[i, keep[i]] for i in members]).to(weight.device, weight.dtype)
            for slot, visual in zip(members, project_visual_features(model, chosen), strict=True):
                inputs[slot] = visual
        lengths = torch.tensor([int(indices.numel()) for indices in keep])
        packed = torch.cat(inputs)  # type: ignore[arg-type]
        front = visual_front(model, k.prefix_ids, k.first_cut, lengths)
        rows = front(packed)
        self.calls += 1
        seed = self.chain.seed_for(0, 0, self.calls)
        defended = self.chain.apply((ACTIVATION,), Payload(rows, lengths, inputs=packed, front=front), seed)
        return list(torch.split(defended.rows, lengths.tolist()))


class AttackerEdge:
    """The run's EDGE-stage defenses as the attacker runs them on its own auxiliary images."""

    def __init__(self, knowledge: AttackerKnowledge, chain: DefenseChain, seed: int, batch_size: int = 256) -> None:
        self.knowledge = knowledge
        self.chain = DefenseChain(chain.at(EDGE), seed=seed)
        self.reorders = any(defense.reorders for defense in self.chain.defenses)
        self.batch_size = batch_size
        # Every call draws anew (its own step), from the attacker's seed.
        self.calls = 0
        self.share: float | None = None

    @property
    def names(self) -> list[str]:
        return self.chain.names

    def sends(self, pixel_values: torch.Tensor, keep: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The edge's vision rows on the patch grid [B, N, Dv] (zeros where no token stands) and, per
        image, the positions a client whose pruning keeps `keep[b]` sends: in the edge's order when
        it reorders, else in `keep`'s."""
        k = self.knowledge
        self.calls += 1
        grids, sent = [], []
        for chunk, start in enumerate(range(0, pixel_values.shape[0], self.batch_size)):
            seed = self.chain.seed_for(0, chunk, self.calls)
            output: EdgeOutput = edge_vision_tokens(k.model, pixel_values[start : start + self.batch_size].to(k.device),
                                                    self.chain, seed)
            grids.append(edge_grid(output, k.num_patches).cpu())
            chunk_keep = keep[start : start + self.batch_size]
            if self.reorders:
                sent += [where.cpu() for where in select_sent(output, chunk_keep, k.num_patches)[1]]
                continue
            for where, kept in zip(output.positions, chunk_keep, strict=True):
                present = torch.zeros(k.num_patches, dtype=torch.bool)
                present[where.cpu()] = True
                sent.append(kept[present[kept]])
        return torch.cat(grids), sent

    def kept_share(self, images: Sequence[VQASample]) -> float:
        """The share of the patches' tokens the edge leaves (what drops and merges remove), measured
        once, on these images: the same for every image, since each operation removes r per block."""
        if self.share is None:
            n = self.knowledge.num_patches
            _, sent = self.sends(self.knowledge.pixel_values(list(images)), [torch.arange(n)] * len(images))
            self.share = sum(s.numel() for s in sent) / (n * len(images))
        return self.share


class AdaptiveAttack(Attack):
    """An attack whose `adaptive` option (with `seed` and `batch_size`) re-applies the run's defenses
    to the rows its own front computes for its auxiliary images."""

    # The run's config (prepare_replay): where an adaptive attack finds the run's defenses.
    run_config: SimConfig | None = None
    # The attacker's copies of the run's ACTIVATION and EDGE defenses (None: none, or not known
    # yet), and the names of all it adapted to (None: not resolved).
    defense: AttackerDefense | None = None
    edge: AttackerEdge | None = None
    adapted_to: list[str] | None = None

    @classmethod
    def fit_adapts_to_defenses(cls, options: Mapping[str, Any]) -> bool:
        return bool(options.get("adaptive", False))

    def prepare_replay(self, run: ReplayContext) -> None:
        """An adaptive attack takes the run's defenses from its config (each run its own)."""
        self.run_config = run.config
        self.defense, self.edge, self.adapted_to = None, None, None
        if self.options.adaptive:
            self.use_defenses(defenses_for_run(self.name, self.run_config))

    def use_defenses(self, chain: DefenseChain) -> "AdaptiveAttack":
        """Re-apply `chain`'s EDGE and ACTIVATION defenses to the attacker's rows, drawing from the
        attack's own seed: what `adaptive` does with the run's. A chain with none leaves it plain."""
        seed = self.options.seed
        defense, edge = AttackerDefense(self.knowledge, chain, seed=seed), AttackerEdge(self.knowledge, chain, seed=seed)
        self.defense, self.edge = (defense if defense.names else None), (edge if edge.names else None)
        self.adapted_to = edge.names + defense.names
        return self

    def resolve_defenses(self, recording: Recording | None = None) -> None:
        """An adaptive attack not yet told the run's defenses reads them from the recording's header."""
        if self.options.adaptive and self.adapted_to is None:
            self.use_defenses(defenses_for_run(self.name, self.run_config, recording))

    def policy_view(self, images: Sequence[VQASample], features: torch.Tensor) -> "PolicyView | None":
        """The run's pruning policy applied to the attacker's own images (`policy_view`)."""
        return policy_view(self.knowledge, self.run_config, images, features, self.options.batch_size)

    def attacker_rows(
        self, model: nn.Module, features: torch.Tensor, images: Sequence[VQASample], keep: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The visual rows `model` computes for auxiliary `images` (their undefended vision `features`)
        whose pruning keeps `keep`, and the positions sent: through the run's edge and then its
        activation defenses when adapted to them (in batches of `batch_size`: a defense that looks
        through the front holds a batch's graph), else `attacks.knowledge.visual_rows`."""
        k = self.knowledge
        if self.edge is not None:
            features, keep = self.edge.sends(k.pixel_values(list(images)), keep)
        if self.defense is None:
            return visual_rows(model, features, k.prefix_ids, k.first_cut, keep), list(keep)
        step = max(1, self.options.batch_size)
        rows = [r for start in range(0, features.shape[0], step)
                for r in self.defense.visual_rows(model, features[start : start + step], keep[start : start + step])]
        return rows, list(keep)


@dataclass(frozen=True)
class PolicyView:
    """What the run's pruning policy makes of the attacker's own images: per image the kept
    positions, and the features [n, N, Dv] with each kept position holding the row the policy
    sends there (a merging policy's mixed rows; else the features themselves)."""

    keep: list[torch.Tensor]
    features: torch.Tensor


def policy_view(
    knowledge: AttackerKnowledge, config: SimConfig | None, images: Sequence[VQASample], features: torch.Tensor,
    batch_size: int,
) -> PolicyView | None:
    """The run's pruning policy applied to the attacker's own `images` (their vision `features`):
    the policy built from the run's config as a client builds it, so with its settings and, for a
    trained policy (DTP), the run's prepared artefacts. None without the run's config, or when
    the run prunes nothing."""
    if config is None or config.pruning.policy == "off":
        return None
    k = knowledge
    selector = build_selector(config, tokenizer=k.tokenizer, samples=images, device=k.device, model=k.model,
                              instruction=k.instruction, pixel_values=k.pixel_values)
    step = max(1, batch_size)
    keep, sent = [], []
    for start in range(0, len(images), step):
        chunk = features[start : start + step].to(k.device)
        selection = selector(chunk, images[start : start + step])
        keep += [indices.cpu() for indices in selection.keep]
        sent.append(selection.sent_grid(chunk).cpu())
    return PolicyView(keep, torch.cat(sent))


def visual_front(
    model: nn.Module, prefix_ids: torch.Tensor, cut: int, lengths: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Packed visual input rows (projected visual tokens, [sum k_b, D]) -> their packed rows at `cut`,
    each sample behind the template's prefix (as `visual_rows` runs them): `Payload.front` for
    the attacker's samples."""
    parts = llava_parts(model)
    device = parts.lm_head.weight.device
    with torch.no_grad():
        prefix = parts.language_model.embed_tokens(prefix_ids.to(device)).detach()
    sizes = [int(n) for n in lengths.tolist()]
    groups = _by_size(sizes)
    skip = prefix_ids.numel()

    def front(inputs: torch.Tensor) -> torch.Tensor:
        samples = torch.split(inputs, sizes)
        out: list[torch.Tensor | None] = [None] * len(sizes)
        for members in groups.values():
            visual = torch.stack([samples[i] for i in members])
            hidden = torch.cat([prefix.to(visual.dtype).unsqueeze(0).expand(len(members), -1, -1), visual], dim=1)
            length = hidden.shape[1]
            mask = torch.ones(len(members), length, dtype=torch.long, device=hidden.device)
            positions = torch.arange(length, device=hidden.device).unsqueeze(0).expand(len(members), -1)
            rows = run_decoder_layers(model, hidden, mask, positions, 0, cut)[:, skip:]
            for slot, index in enumerate(members):
                out[index] = rows[slot]
        return torch.cat(out)  # type: ignore[arg-type]

    return front


def _by_size(sizes: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for index, size in enumerate(sizes):
        groups.setdefault(size, []).append(index)
    return groups
