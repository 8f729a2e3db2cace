"""SARA (SPEC.md §3), aimed at what QPriv-VL sends: a pruned, possibly shuffled set of visual rows.

1. Token position predictor (TPP): per received row, logits over the N patch
   positions; each row goes to its arg-max position if confident enough, colliding
   rows keep the most confident, empty positions stay zero.
2. Feature-space masked autoencoder (MAE): the sparse grid -> the full grid of rows
   an unpruned front would have sent.
3. Decoder (`GridDecoder`): full grid -> image.

All three are trained on the attacker's auxiliary images through its copy of the
public front. The TPP learns from simulated sends: random keep sets (share drawn from
`keep_ratios`) in random order when `shuffle`. Pruned rows are *recomputed* for each
keep set — after the front's attention and rotary positions they differ from the
unpruned rows of the same patches. Adaptive (`adaptive=True`) the simulated sends go
through the attacker's copies of the run's edge (token shuffling, merging, dropping, the
positionless tower) and activation defenses (attacks.adaptive), so the TPP learns to place
merged and surviving tokens in the order the edge sends them, as the defenses leave them.

As the paper trains them (`stage_inputs="paper"`), the MAE restores full grids with a
random share of their rows zeroed and the decoder inverts full grids, each independently
of the stages before it. `stage_inputs="chained"` trains each later stage on the previous
stage's real outputs instead (the MAE on the TPP's placement of recomputed pruned rows,
misplaced and dropped rows included; the decoder on the MAE's output), which is what it
meets in an attack. The MAE's output replaces every slot, as the paper's restores the full
grid; `mae_fills="empty"` keeps the rows the TPP placed and restores only the empty slots,
so that the decoder reads the rows an attack observed rather than the MAE's smoothed copy.

Structure and budgets are the paper's (Table 1): the TPP is Linear D→D/2, two Transformer
encoder layers, Linear→N (ViT-B: 768→384); the MAE four encoder layers at the row width D
with a learned positional embedding; the decoder a linear projection and transposed
convolutions from `decoder_width` channels, halving (ViT-B: 768→256→128→64→32), then a
3×3 convolution to RGB. TPP and decoder train 20 epochs, the MAE 10, at learning rates
1e-4, 1e-3 (decoder) and 1e-4. An epoch is ceil(items / batch_size) minibatches drawn at
random. The paper's auxiliary set is a quarter of ImageNet's training split; a run's is
`threat.aux_limit` rows of `threat.aux_split` (set them to a quarter of a training split no
client uses to match it), far fewer images, so the paper's epochs are far fewer steps.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from attacks.adaptive import AdaptiveAttack
from attacks.base import ACTIVATION, IMAGE, PASSIVE, AttackResult, Truth, register_attack
from attacks.knowledge import visual_rows
from attacks.metrics import image_metrics
from attacks.networks import (
    FeatureMAE,
    GridDecoder,
    TokenPositionPredictor,
    adam_steps,
    assign_positions,
    place_on_grid,
    seeded,
    spread_slots,
)
from attacks.observations import VisualSpans, fewer_visual_rows, score_images, visual_observations
from attacks.recording import Recording
from vqa import VQASample

STAGE_INPUTS = ("paper", "chained")
MAE_FILLS = ("all", "empty")


@dataclass
class SARAOptions:
    keep_ratios: tuple[float, float] = (0.3, 1.0)
    shuffle: bool = True
    # Simulated sends per auxiliary image (each its own keep set and order).
    variants_per_image: int = 2
    tpp_epochs: int = 20
    tpp_lr: float = 1e-4
    # None: half the row width, as ViT-B's 768 -> 384.
    tpp_width: int | None = None
    mae_epochs: int = 10
    mae_lr: float = 1e-4
    mae_layers: int = 4
    # The share of positions the paper-trained MAE's inputs zero, drawn per grid (the paper
    # does not give it). None: what a simulated send leaves out (1 - keep_ratios); a
    # shuffle-only attacker still needs some, for positions the TPP's collisions leave empty.
    mae_mask_ratios: tuple[float, float] | None = None
    # Which slots of a placed grid the MAE's output replaces: "all" (the paper's MAE restores the
    # full grid) or only the "empty" ones, the rows the TPP placed kept as they arrived.
    mae_fills: str = "all"
    decoder_epochs: int = 20
    decoder_lr: float = 1e-3
    # The first transposed convolution's channels (the paper's 256 after ViT-B's 768).
    decoder_width: int = 256
    # What the MAE and the decoder learn from: "paper" (full grids, independently) or
    # "chained" (the previous stage's outputs).
    stage_inputs: str = "paper"
    # τ: a row is placed only if its top position probability reaches it (the paper uses 0).
    threshold: float = 0.0
    # Simulate the sends through the attacker's copy of the run's defenses (attacks.adaptive):
    # tokens the edge merged or dropped, in the order it sends them, as the defenses leave them.
    adaptive: bool = False
    batch_size: int = 32
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        low, high = self.keep_ratios
        if not 0 < low <= high <= 1:
            raise ValueError(f"keep_ratios={self.keep_ratios} must satisfy 0 < low <= high <= 1")
        if self.mae_mask_ratios is not None and not 0 <= self.mae_mask_ratios[0] <= self.mae_mask_ratios[1] < 1:
            raise ValueError(f"mae_mask_ratios={self.mae_mask_ratios} must satisfy 0 <= low <= high < 1 (or None)")
        if self.stage_inputs not in STAGE_INPUTS:
            raise ValueError(f"stage_inputs={self.stage_inputs!r}; allowed: {', '.join(STAGE_INPUTS)}")
        if self.mae_fills not in MAE_FILLS:
            raise ValueError(f"mae_fills={self.mae_fills!r}; allowed: {', '.join(MAE_FILLS)}")
        for name in ("variants_per_image", "batch_size", "mae_layers", "decoder_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("tpp_epochs", "mae_epochs", "decoder_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 0")
        if self.tpp_width is not None and self.tpp_width < 1:
            raise ValueError(f"tpp_width={self.tpp_width} must be at least 1 (or None: half the row width)")


class SARA(AdaptiveAttack):
    name = "sara"
    threat_model = PASSIVE
    kind = IMAGE
    reads = (ACTIVATION,)
    headline = ("psnr", "position_accuracy")
    Options = SARAOptions

    def fit(self, aux: Sequence[VQASample]) -> "SARA":
        k, o = self.knowledge, self.options
        if o.adaptive and self.adapted_to is None:
            raise ValueError("sara with adaptive=True simulates the run's defenses: replay it on a run folder "
                             "(prepare_replay hands it the run's config) or call use_defenses(chain) before fit")
        self.aux = list(aux)
        pixels = k.pixel_values(self.aux)
        self.aux_images = k.unit_images(pixels)
        features = k.features(pixels)
        n = k.num_patches
        generator = torch.Generator().manual_seed(o.seed)
        with torch.no_grad():
            full = torch.stack(visual_rows(k.model, features, k.prefix_ids, k.first_cut))
            sent_rows, positions = [], []
            for _ in range(o.variants_per_image):
                rows, sent = self.attacker_rows(k.model, features, self.aux,
                                                [self._simulated_keep(generator) for _ in self.aux])
                sent_rows += rows
                positions += sent
            # The auxiliary image behind each simulated row set.
            source = torch.arange(len(self.aux)).repeat(o.variants_per_image)
        with seeded(o.seed):
            self.tpp = TokenPositionPredictor(k.hidden_size, n, o.tpp_width or max(1, k.hidden_size // 2))
            self.mae = FeatureMAE(k.hidden_size, n, o.mae_layers)
            self.decoder = GridDecoder(k.hidden_size, k.grid, k.image_size, o.decoder_width)
        padded, padding = _pad(sent_rows)
        targets = torch.full(padding.shape, -100, dtype=torch.long)
        for i, p in enumerate(positions):
            targets[i, : p.numel()] = p

        def tpp_loss(batch: torch.Tensor) -> torch.Tensor:
            logits = self.tpp(padded[batch], padding[batch])
            return F.cross_entropy(logits.flatten(0, 1), targets[batch].flatten(), ignore_index=-100)

        self._train(self.tpp, tpp_loss, len(sent_rows), o.tpp_epochs, o.tpp_lr)
        if o.stage_inputs == "chained":
            placed = place_on_grid(sent_rows, self.predict_positions(sent_rows), n)
            self._train(self.mae, lambda b: F.mse_loss(self.mae(placed[b]), full[source[b]]),
                        len(sent_rows), o.mae_epochs, o.mae_lr)
            with torch.no_grad():
                decoder_inputs = torch.cat([self.restore_grid(placed[i : i + 256])
                                            for i in range(0, len(sent_rows), 256)])
            decoder_source = source
        else:
            # The paper's MAE: full grids with the rows of a random share of positions zeroed,
            # drawn afresh for every minibatch.
            mask_generator = torch.Generator().manual_seed(o.seed + 1)

            def mae_loss(batch: torch.Tensor) -> torch.Tensor:
                masked = full[source[batch]].clone()
                for row in masked:
                    row[self._dropped(mask_generator)] = 0
                return F.mse_loss(self.mae(masked), full[source[batch]])

            self._train(self.mae, mae_loss, len(sent_rows), o.mae_epochs, o.mae_lr)
            decoder_inputs, decoder_source = full, torch.arange(len(self.aux))
        self._train(self.decoder,
                    lambda b: F.mse_loss(self.decoder(decoder_inputs[b]), self.aux_images[decoder_source[b]]),
                    len(decoder_inputs), o.decoder_epochs, o.decoder_lr)
        return self

    def _train(self, module: torch.nn.Module, loss, items: int, epochs: int, lr: float) -> None:
        o = self.options
        steps = epochs * math.ceil(items / o.batch_size)
        bar = tqdm(total=steps, desc=f"SARA {type(module).__name__}", disable=not o.progress)
        adam_steps(module.parameters(), loss, items, steps=steps, lr=lr, batch_size=o.batch_size, seed=o.seed,
                   progress=bar.update)
        bar.close()
        module.eval()

    def _dropped(self, generator: torch.Generator) -> torch.Tensor:
        """The positions one of the MAE's training grids has zeroed: `mae_mask_ratios` of them, or
        by default those a simulated send leaves out."""
        n, ratios = self.knowledge.num_patches, self.options.mae_mask_ratios
        if ratios is None:
            left_out = torch.ones(n, dtype=torch.bool)
            left_out[self._simulated_keep(generator)] = False
            return left_out.nonzero().flatten()
        share = ratios[0] + (ratios[1] - ratios[0]) * float(torch.rand((), generator=generator))
        return torch.randperm(n, generator=generator)[: round(share * n)]

    def _simulated_keep(self, generator: torch.Generator) -> torch.Tensor:
        n = self.knowledge.num_patches
        low, high = self.options.keep_ratios
        share = low + (high - low) * float(torch.rand((), generator=generator))
        keep = torch.randperm(n, generator=generator)[: max(1, round(share * n))]
        return keep if self.options.shuffle else keep.sort().values

    # -- the attack on rows ----------------------------------------------------------------
    @torch.no_grad()
    def predict_positions(self, observed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per row set, the grid slot of each row (−1: left out)."""
        padded, padding = _pad([rows.float() for rows in observed])
        logits = self.tpp(padded, padding)
        return [assign_positions(logits[i, : rows.shape[0]], self.options.threshold)
                for i, rows in enumerate(observed)]

    @torch.no_grad()
    def reconstruct(self, observed: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Images and the predicted slots for observed row sets."""
        slots = self.predict_positions(observed)
        grid = place_on_grid([rows.float() for rows in observed], slots, self.knowledge.num_patches)
        return self.decoder(self._complete(grid, slots)), slots

    def _complete(self, grid: torch.Tensor, slots: Sequence[torch.Tensor]) -> torch.Tensor:
        """The MAE's restoration of each grid with empty positions; a full grid passes as it is
        (the paper bypasses the MAE then)."""
        full = torch.tensor([int((s >= 0).sum()) == self.knowledge.num_patches for s in slots])
        return torch.where(full[:, None, None], grid, self.restore_grid(grid))

    def restore_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """The MAE's restoration of placed grids [B, N, D] (zero rows: slots nothing was placed in),
        in the slots `mae_fills` names."""
        restored = self.mae(grid)
        if self.options.mae_fills == "empty":
            restored = torch.where(grid.abs().sum(-1, keepdim=True) > 0, grid, restored)
        return restored

    @torch.no_grad()
    def reconstruct_without_positions(self, observed: Sequence[torch.Tensor]) -> torch.Tensor:
        """The same pipeline with rows spread in arrival order instead of the TPP's placement:
        the attacker that shuffling is meant to stop."""
        slots = [spread_slots(rows.shape[0], self.knowledge.num_patches) for rows in observed]
        grid = place_on_grid([rows.float() for rows in observed], slots, self.knowledge.num_patches)
        return self.decoder(self._complete(grid, slots))

    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        k = self.knowledge
        spans = VisualSpans(k, k.first_cut).fit(self.aux) if fewer_visual_rows(recording.config) else None
        observations = visual_observations(recording, k, attack=self.name, spans=spans)
        rows = [obs.rows for obs in observations]
        images, slots = self.reconstruct(rows)
        result = AttackResult(
            self.name,
            details={"observed_samples": len(rows), "mean_kept_tokens": sum(r.shape[0] for r in rows) / len(rows),
                     "adaptive_to": self.adapted_to},
            outputs={"reconstructions": images},
        )
        if truth is None:
            return result
        score = score_images(observations, images, k, truth, self.aux, self.aux_images)
        if score is not None:
            result.metrics.update(score.metrics)
            plain = image_metrics(self.reconstruct_without_positions(rows)[score.known], score.targets)
            result.metrics.update({f"without_positions_{name}": value for name, value in plain.items()})
            result.outputs["targets"] = score.targets
        true_slots = [
            (keep[obs.index] if keep is not None else None)
            for obs, keep in ((obs, truth.keep_sets(obs.entry)) for obs in observations)
        ]
        if all(t is not None for t in true_slots):
            result.metrics.update(position_metrics(slots, true_slots, k.num_patches))
        return result


def position_metrics(
    predicted: Sequence[torch.Tensor], true: Sequence[torch.Tensor], num_patches: int
) -> dict[str, float]:
    """Share of sent rows placed at their true patch, for SARA and for the in-order spread guess.

    When the attacker miscounted a sample's visual rows (pruned runs), rows are compared in
    order up to the shorter count; the rest count as misplaced.
    """
    def hits(guess: torch.Tensor, target: torch.Tensor) -> int:
        common = min(guess.numel(), target.numel())
        return int((guess[:common] == target[:common]).sum())

    total = sum(t.numel() for t in true)
    return {
        "position_accuracy": sum(hits(p, t) for p, t in zip(predicted, true, strict=True)) / total,
        "spread_position_accuracy": sum(hits(spread_slots(t.numel(), num_patches), t) for t in true) / total,
        "chance_position_accuracy": 1 / num_patches,
        "visual_count_accuracy": sum(p.numel() == t.numel() for p, t in zip(predicted, true, strict=True))
        / len(true),
    }


def _pad(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sets -> [B, k_max, D] and a padding mask (True where there is no row)."""
    longest = max(r.shape[0] for r in rows)
    padded = rows[0].new_zeros(len(rows), longest, rows[0].shape[-1])
    padding = torch.ones(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        padded[i, : r.shape[0]] = r
        padding[i, : r.shape[0]] = False
    return padded, padding


register_attack(SARA)
