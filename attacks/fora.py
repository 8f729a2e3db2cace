"""FORA (Xu et al., CVPR 2024): a passive server inverts the client's smashed data.

1. Substitute client: the attacker's copy of the public front, whose adapters in
   front of the cut are trained so that its visual rows on auxiliary images follow
   the distribution of the rows the server observed — multi-kernel MMD plus a
   discriminator, as in the paper, both over whole feature maps.
2. Inverse network: a `GridDecoder` trained on (substitute rows, auxiliary image).
3. Inversion: the decoder applied to the observed rows.

Pruned runs send k_b < N rows whose patches the server does not know: the attacker
simulates random keep sets of the observed sizes on its auxiliary data, spreads each
in-order set evenly over the grid, and lets the decoder learn from that. With
`policy_aware` it prunes its auxiliary images with the run's own policy instead
(attacks.adaptive.AdaptiveAttack.policy_view), so it learns the rows a client's
policy keeps, not a random share of them.

Adaptive (`adaptive=True`; the attacker knows the run's defense and its options): the
substitute's auxiliary rows pass through the run's edge (token shuffling, merging,
dropping, the positionless tower) and activation-stage defenses (attacks.adaptive: the
run's options, the attacker's own seed) both where the substitute is fitted to the
observed rows (so defended substitute rows are matched to the defended observations)
and where the inverse network is trained, so the decoder learns to invert defended
rows. Its input noise then spares the elements the defense zeroed (the observations
carry those zeros exactly). Through an edge that drops or merges tokens, a simulated
keep set is larger than the observed count by the share of tokens the edge leaves, so
that what survives the attacker's edge is as many rows as a client sent.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from attacks.adaptive import AdaptiveAttack
from attacks.base import ACTIVATION, IMAGE, PASSIVE, AttackResult, Truth, register_attack
from attacks.networks import (
    GridDecoder,
    GridDiscriminator,
    adam_steps,
    mk_mmd,
    place_on_grid,
    seeded,
    spread_slots,
)
from attacks.observations import VisualSpans, fewer_visual_rows, score_images, visual_observations
from attacks.recording import Recording
from vqa import VQASample


@dataclass
class FORAOptions:
    substitute_steps: int = 500
    substitute_lr: float = 1e-3
    mmd_weight: float = 1.0
    adversarial_weight: float = 0.1
    decoder_steps: int = 2000
    decoder_lr: float = 1e-3
    decoder_width: int = 128
    # Gaussian noise on the decoder's training inputs, relative to the rows' standard deviation.
    decoder_noise: float = 0.3
    batch_size: int = 32
    # Train substitute and inverse network on auxiliary rows through the run's defenses.
    adaptive: bool = False
    # Prune the auxiliary images as the run's pruning policy would (it knows the policy and its
    # settings); False: random keep sets of the observed sizes.
    policy_aware: bool = False
    seed: int = 0
    progress: bool = True


class FORA(AdaptiveAttack):
    name = "fora"
    threat_model = PASSIVE
    kind = IMAGE
    reads = (ACTIVATION,)
    headline = ("psnr", "mark_readback")
    Options = FORAOptions
    # The run's policy's keep sets of the auxiliary images (policy_aware), and the features their
    # rows are read from (`fit`: the auxiliary images'; `reconstruct`: with the policy's merged
    # rows where it merges).
    policy_keep: list[torch.Tensor] | None = None
    sent_features: torch.Tensor | None = None

    def _rows(self, model: torch.nn.Module, batch: torch.Tensor, keep) -> list[torch.Tensor]:
        """The attacker's visual rows for the auxiliary images at `batch`: through the defenses when adaptive.

        In float32 on the CPU, where the observations and FORA's own networks are, whatever device
        and dtype the model computes in (a GPU and bf16 at 7B); still in the substitute's graph."""
        rows = self.attacker_rows(model, self.sent_features[batch], [self.aux[int(i)] for i in batch], keep)[0]
        return [r.float().cpu() for r in rows]

    def fit(self, aux: Sequence[VQASample]) -> "FORA":
        """Keeps the auxiliary images and their frozen vision features (FORA trains on the observations)."""
        k = self.knowledge
        self.aux = list(aux)
        pixels = k.pixel_values(self.aux)
        self.aux_images = k.unit_images(pixels)
        self.aux_features = k.features(pixels)
        self.sent_features = self.aux_features
        return self

    # -- the attack on rows, usable without a recording -----------------------------------
    def reconstruct(self, observed: Sequence[torch.Tensor]) -> torch.Tensor:
        """Images [n, 3, H, W] from observed visual row sets [k_b, D]."""
        if not hasattr(self, "aux_features"):
            raise RuntimeError("FORA.fit(aux) must run before reconstruct")
        self.resolve_defenses()
        view = self.policy_view(self.aux, self.aux_features) if self.options.policy_aware else None
        self.policy_keep, self.sent_features = (None, self.aux_features) if view is None else (view.keep, view.features)
        observed = [rows.float() for rows in observed]
        counts = [rows.shape[0] for rows in observed]
        substitute = self.fit_substitute(observed, counts)
        decoder = self.train_inverse_network(substitute, counts)
        with torch.no_grad():
            grid = self._grid(observed)
            return torch.cat([decoder(grid[i : i + 256]) for i in range(0, grid.shape[0], 256)])

    def _aux_keep(self, counts: Sequence[int], generator: torch.Generator, batch: torch.Tensor) -> list[torch.Tensor]:
        """The keep sets of the auxiliary images at `batch`: the run's policy's (`policy_aware`), else
        random in-order ones whose sizes follow the observed counts (before the edge's drops)."""
        if self.policy_keep is not None:
            return [self.policy_keep[int(i)] for i in batch]
        n, size = self.knowledge.num_patches, len(batch)
        chosen = torch.randint(len(counts), (size,), generator=generator)
        share = 1.0 if self.edge is None else self.edge.kept_share(self.aux[:8])
        return [torch.randperm(n, generator=generator)[: min(n, round(counts[int(i)] / share))].sort().values
                for i in chosen]

    def _grid(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        n = self.knowledge.num_patches
        return place_on_grid(list(rows), [spread_slots(r.shape[0], n) for r in rows], n)

    def fit_substitute(self, observed: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.nn.Module:
        """The public front, its adapters fitted so that whole samples' rows (on the grid) match the
        observed ones in distribution: MK-MMD plus a discriminator, both over whole feature maps
        (per-row matching lets a substitute reproduce the rows' marginal with the wrong image)."""
        k, o = self.knowledge, self.options
        substitute = k.trainable_front()
        with seeded(o.seed):
            discriminator = GridDiscriminator(k.hidden_size, k.grid)
        observed_grid = self._grid(observed)
        generator = torch.Generator().manual_seed(o.seed)
        params = [p for p in substitute.parameters() if p.requires_grad]
        sub_opt = torch.optim.Adam(params, lr=o.substitute_lr)
        disc_opt = torch.optim.Adam(discriminator.parameters(), lr=o.substitute_lr)
        size = min(o.batch_size, len(self.aux), len(observed))
        for _ in tqdm(range(o.substitute_steps), desc="FORA substitute", disable=not o.progress):
            batch = torch.randint(len(self.aux), (size,), generator=generator)
            keep = self._aux_keep(counts, generator, batch)
            fake = self._grid(self._rows(substitute, batch, keep))
            real = observed_grid[torch.randint(len(observed), (size,), generator=generator)]
            # The discriminator learns observed (1) vs substitute (0); the substitute learns to fool it.
            disc_loss = F.binary_cross_entropy_with_logits(discriminator(real), torch.ones(size)) + \
                F.binary_cross_entropy_with_logits(discriminator(fake.detach()), torch.zeros(size))
            disc_opt.zero_grad(set_to_none=True)
            disc_loss.backward()
            disc_opt.step()
            sub_loss = o.mmd_weight * mk_mmd(fake.flatten(1), real.flatten(1)) + o.adversarial_weight * \
                F.binary_cross_entropy_with_logits(discriminator(fake), torch.ones(size))
            sub_opt.zero_grad(set_to_none=True)
            sub_loss.backward()
            sub_opt.step()
        return substitute.requires_grad_(False)

    def inverse_training_rows(self, substitute: torch.nn.Module, counts: Sequence[int],
                              generator: torch.Generator | None = None) -> torch.Tensor:
        """The inverse network's inputs: the substitute's rows for every auxiliary image (keep sets of
        the observed sizes; through the run's defenses when adaptive) on the grid, [n, N, D]."""
        generator = torch.Generator().manual_seed(self.options.seed + 1) if generator is None else generator
        everyone = torch.arange(len(self.aux))
        keep = self._aux_keep(counts, generator, everyone)
        with torch.no_grad():
            return self._grid(self._rows(substitute, everyone, keep))

    def train_inverse_network(self, substitute: torch.nn.Module, counts: Sequence[int]) -> GridDecoder:
        k, o = self.knowledge, self.options
        generator = torch.Generator().manual_seed(o.seed + 1)
        grid = self.inverse_training_rows(substitute, counts, generator)
        # The defense's zeros are exact in the observations: the input noise spares them.
        noisy_where = (grid != 0).to(grid.dtype) if self.defense is not None else None
        with seeded(o.seed):
            decoder = GridDecoder(k.hidden_size, k.grid, k.image_size, o.decoder_width)
        bar = tqdm(total=o.decoder_steps, desc="FORA inverse network", disable=not o.progress)
        # Noise on the inputs keeps the decoder from relying on the substitute's exact rows, which
        # the victim's only approximate.
        scale = o.decoder_noise * grid.std()

        def loss(batch: torch.Tensor) -> torch.Tensor:
            noise = scale * torch.randn(grid[batch].shape, generator=generator)
            noisy = grid[batch] + (noise if noisy_where is None else noise * noisy_where[batch])
            return F.mse_loss(decoder(noisy), self.aux_images[batch])

        adam_steps(decoder.parameters(), loss, len(self.aux),
            steps=o.decoder_steps, lr=o.decoder_lr, batch_size=o.batch_size, seed=o.seed, progress=bar.update)
        bar.close()
        return decoder.eval()

    # -- the attack on a recording ---------------------------------------------------------
    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        k = self.knowledge
        self.resolve_defenses(recording)
        spans = VisualSpans(k, k.first_cut).fit(self.aux) if fewer_visual_rows(recording.config) else None
        observations = visual_observations(recording, k, attack=self.name, spans=spans)
        images = self.reconstruct([obs.rows for obs in observations])
        result = AttackResult(
            self.name,
            details={"observed_samples": len(observations),
                     "mean_kept_tokens": sum(obs.rows.shape[0] for obs in observations) / len(observations),
                     "adaptive_to": self.adapted_to},
            outputs={"reconstructions": images},
        )
        score = None if truth is None else score_images(observations, images, k, truth, self.aux, self.aux_images)
        if score is not None:
            result.metrics.update(score.metrics)
            result.outputs["targets"] = score.targets
        return result


register_attack(FORA)
