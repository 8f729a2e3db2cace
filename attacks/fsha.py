"""FSHA (Pasquini et al., CCS 2021): a malicious server hijacks the client's training.

The server keeps three networks of its own:
- a pilot f̃ (the attacker's copy of the public front, its adapters trainable) and a
  decoder f̃⁻¹ (`GridDecoder`), trained together as an autoencoder on public images,
  so that the decoder inverts the pilot's feature space;
- a discriminator D (`GridDiscriminator`, over whole feature maps), trained with the Wasserstein loss and
  gradient penalty (the paper's choice) to tell the pilot's rows from the client's.

Instead of its legitimate gradient the server returns ∂(−D(client rows))/∂rows, so the
client's own optimiser moves its front into the pilot's feature space — where the
decoder inverts it. `server_step` is one such exchange (the hook an active strategy
calls with each received activation); `simulate_hijack` plays the client's side
offline; `run` decodes the activations a hijacked run recorded, with the server state
it saved (`save_state` / `load_state`).

Adaptive (`adaptive=True`; the attacker knows the run's defense and its options): at
replay time, after loading the run's hijack state, the decoder is fine-tuned for
`adaptive_steps` on the pilot's auxiliary rows passed through the run's
activation-stage defenses (attacks.adaptive: the run's options, the attacker's own
seed, fresh draws each step), so it inverts defended rows. The pilot, discriminator,
their optimisers and the hijack's generator stay as the run left them; only the
decoder moves, with an optimiser of its own.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from attacks.adaptive import AttackerDefense, defenses_for_run, policy_view
from attacks.base import ACTIVATION, ACTIVE, IMAGE, Attack, AttackResult, Truth, register_attack
from attacks.knowledge import split_packed, visual_rows
from attacks.networks import (
    GridDecoder,
    GridDiscriminator,
    place_on_grid,
    seeded,
    spread_slots,
)
from attacks.observations import VisualSpans, fewer_visual_rows, score_images, visual_observations
from attacks.recording import Recording
from attacks.context import ATTACK_FOLDER, ReplayContext
from config import SimConfig
from privacy import DefenseChain
from vqa import VQASample

STATE_FILE = "fsha.pt"


@dataclass
class FSHAOptions:
    # Autoencoder steps on public data before the first hijacked exchange.
    pretrain_steps: int = 500
    lr: float = 1e-3
    discriminator_lr: float = 1e-3
    gradient_penalty: float = 10.0
    # Discriminator updates per hijacked exchange (WGAN's n_critic); the autoencoder takes one.
    discriminator_steps: int = 3
    decoder_width: int = 128
    batch_size: int = 32
    # Rounds of the recording to decode: the last ones, after the hijack took hold; 0: all.
    last_rounds: int = 1
    # Fine-tune the decoder on the pilot's rows through the run's defenses, for this many steps.
    adaptive: bool = False
    adaptive_steps: int = 500
    # Prune the pilot's public images with the run's own policy (it knows the policy and its
    # settings), so pilot and client rows are alike under pruning; False: all visual tokens.
    policy_aware: bool = False
    seed: int = 0
    progress: bool = True


class FSHA(Attack):
    name = "fsha"
    threat_model = ACTIVE
    kind = IMAGE
    reads = (ACTIVATION,)
    headline = ("psnr", "mark_readback")
    Options = FSHAOptions
    fit_reads_run = True

    # A hijacked run's saved server state (prepare_replay), loaded by `fit` in place of pre-training.
    saved_state: Path | None = None
    # The run's policy's keep sets of the auxiliary images (policy_aware), and the features their
    # rows are read from (the policy's merged rows where it merges), set by `fit`.
    policy_keep: list[torch.Tensor] | None = None
    sent_features: torch.Tensor | None = None
    # The run's config (prepare_replay): where an adaptive attack finds the run's defenses.
    run_config: SimConfig | None = None
    # The defenses the decoder was fine-tuned on (None: not adapted).
    adapted_to: list[str] | None = None

    def fit(self, aux: Sequence[VQASample]) -> "FSHA":
        """Build the server's networks and pre-train pilot and decoder as an autoencoder on `aux`."""
        k, o = self.knowledge, self.options
        self.aux = list(aux)
        pixels = k.pixel_values(self.aux)
        self.aux_images = k.unit_images(pixels)
        self.aux_features = k.features(pixels)
        self.pilot = k.trainable_front()
        with seeded(o.seed):
            self.decoder = GridDecoder(k.hidden_size, k.grid, k.image_size, o.decoder_width)
            self.discriminator = GridDiscriminator(k.hidden_size, k.grid)
        self.autoencoder_optimizer = torch.optim.Adam(
            [*(p for p in self.pilot.parameters() if p.requires_grad), *self.decoder.parameters()], lr=o.lr
        )
        self.discriminator_optimizer = torch.optim.Adam(
            self.discriminator.parameters(), lr=o.discriminator_lr, betas=(0.5, 0.9)
        )
        self.generator = torch.Generator().manual_seed(o.seed)
        self.adapted_to = None
        view = policy_view(k, self.run_config, self.aux, self.aux_features, o.batch_size) if o.policy_aware else None
        self.policy_keep, self.sent_features = (None, self.aux_features) if view is None else (view.keep, view.features)
        if self.saved_state is not None:
            self.load_state(self.saved_state)
        else:
            for _ in tqdm(range(o.pretrain_steps), desc="FSHA pilot/decoder", disable=not o.progress):
                self._autoencoder_step()
        if o.adaptive and self.run_config is not None:
            self.adapt_decoder(defenses_for_run(self.name, self.run_config))
        return self

    def adapt_decoder(self, chain: DefenseChain) -> "FSHA":
        """Fine-tune the decoder on the pilot's auxiliary rows through `chain`'s activation-stage
        defenses, keeping everything else of the hijack as it is."""
        if not hasattr(self, "pilot"):
            raise RuntimeError("FSHA.fit(aux) must run before its decoder adapts")
        k, o = self.knowledge, self.options
        defense = AttackerDefense(k, chain, seed=o.seed)
        self.adapted_to = defense.names
        if not defense.names:
            return self
        optimizer = torch.optim.Adam(self.decoder.parameters(), lr=o.lr)
        generator = torch.Generator().manual_seed(o.seed + 2)
        size = min(o.batch_size, len(self.aux))
        self.decoder.train()
        for _ in tqdm(range(o.adaptive_steps), desc="FSHA adaptive decoder", disable=not o.progress):
            batch = torch.randint(len(self.aux), (size,), generator=generator)
            with torch.no_grad():
                rows = self._on_grid(defense.visual_rows(self.pilot, self.sent_features[batch], self._keep(batch)))
            loss = F.mse_loss(self.decoder(rows), self.aux_images[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        self.decoder.eval()
        return self

    # -- the server's side of one hijacked exchange ---------------------------------------
    def _aux_batch(self) -> torch.Tensor:
        return torch.randint(len(self.aux), (min(self.options.batch_size, len(self.aux)),), generator=self.generator)

    def _keep(self, batch: torch.Tensor) -> list[torch.Tensor] | None:
        """The policy's keep sets of the auxiliary images at `batch` (None: every visual token)."""
        return None if self.policy_keep is None else [self.policy_keep[int(i)] for i in batch]

    def _on_grid(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pilot's row sets as the networks read them: whole grids, or pruned sets spread over
        the grid as the client's are; in fp32 on the CPU, wherever and in whatever dtype the model runs."""
        rows = [r.float().cpu() for r in rows]
        return torch.stack(rows) if self.policy_keep is None else self._grid(rows)

    def _pilot_rows(self, batch: torch.Tensor) -> torch.Tensor:
        k = self.knowledge
        return self._on_grid(visual_rows(self.pilot, self.sent_features[batch], k.prefix_ids, k.first_cut,
                                         self._keep(batch)))

    def _autoencoder_step(self) -> float:
        self.decoder.train()
        batch = self._aux_batch()
        loss = F.mse_loss(self.decoder(self._pilot_rows(batch)), self.aux_images[batch])
        self.autoencoder_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.autoencoder_optimizer.step()
        return loss.item()

    def _grid(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        n = self.knowledge.num_patches
        return place_on_grid(list(rows), [spread_slots(r.shape[0], n) for r in rows], n)

    def _discriminator_step(self, client_grid: torch.Tensor) -> float:
        with torch.no_grad():
            pilot_grid = self._pilot_rows(self._aux_batch())
        count = min(pilot_grid.shape[0], client_grid.shape[0])
        real, fake = pilot_grid[:count], client_grid[:count]
        # WGAN-GP: the pilot's rows score high, the client's low; the penalty keeps D 1-Lipschitz.
        mix = torch.rand(count, 1, 1, generator=self.generator)
        between = (mix * real + (1 - mix) * fake).requires_grad_()
        slope = torch.autograd.grad(self.discriminator(between).sum(), between, create_graph=True)[0]
        penalty = ((slope.flatten(1).norm(dim=-1) - 1) ** 2).mean()
        loss = self.discriminator(fake).mean() - self.discriminator(real).mean() + \
            self.options.gradient_penalty * penalty
        self.discriminator_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.discriminator_optimizer.step()
        return loss.item()

    def server_step(self, client_rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One hijacked exchange: update the server's networks, return the gradient for each row set.

        `client_rows` are the visual rows [k_b, D] the client sent; the returned
        tensors (same shapes) replace the legitimate gradient at the cut.
        """
        if not hasattr(self, "pilot"):
            raise RuntimeError("FSHA.fit(aux) must run before the hijack")
        rows = [r.detach().float().requires_grad_() for r in client_rows]
        self._autoencoder_step()
        for _ in range(self.options.discriminator_steps):
            self._discriminator_step(self._grid(rows).detach())
        (-self.discriminator(self._grid(rows)).mean()).backward()
        return [r.grad for r in rows]

    def gradients_for_packed(self, rows: torch.Tensor, lengths: torch.Tensor, spans: VisualSpans | None = None
                             ) -> torch.Tensor:
        """`server_step` on a packed activation as the wire carries it: the gradient for every
        row, FSHA's on the visual rows and zero on the text rows (what the server sends back)."""
        prefix = self.knowledge.prefix_ids.numel()
        samples = split_packed(rows, lengths)
        counts = [self.knowledge.num_patches if spans is None else spans.count(s) for s in samples]
        visual = self.server_step([s[prefix : prefix + c] for s, c in zip(samples, counts, strict=True)])
        out = [torch.zeros_like(s, dtype=torch.float32) for s in samples]
        for grad, v, c in zip(out, visual, counts, strict=True):
            grad[prefix : prefix + c] = v
        return torch.cat(out).to(rows.dtype)

    # -- offline: play the client's side ---------------------------------------------------
    def simulate_hijack(
        self, client_front: nn.Module, private: Sequence[VQASample], *, steps: int, client_lr: float = 1e-3
    ) -> nn.Module:
        """Train `client_front`'s trainable parameters with the gradients `server_step` returns
        (the client believes they are its task's) on batches of its private samples."""
        k, o = self.knowledge, self.options
        features = k.features(k.pixel_values(list(private)))
        parameters = [p for p in client_front.parameters() if p.requires_grad]
        if not parameters:
            raise ValueError("the client front has no trainable parameters: nothing can be hijacked")
        optimizer = torch.optim.AdamW(parameters, lr=client_lr)
        generator = torch.Generator().manual_seed(o.seed + 1)
        for _ in tqdm(range(steps), desc="FSHA hijack", disable=not o.progress):
            batch = torch.randint(features.shape[0], (min(o.batch_size, features.shape[0]),), generator=generator)
            rows = visual_rows(client_front, features[batch], k.prefix_ids, k.first_cut)
            grads = self.server_step(rows)
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(rows, grads)
            optimizer.step()
        return client_front

    # -- inversion -------------------------------------------------------------------------
    @torch.no_grad()
    def reconstruct(self, observed: Sequence[torch.Tensor]) -> torch.Tensor:
        n = self.knowledge.num_patches
        self.decoder.eval()
        grid = place_on_grid([r.float() for r in observed], [spread_slots(r.shape[0], n) for r in observed], n)
        return torch.cat([self.decoder(grid[i : i + 256]) for i in range(0, grid.shape[0], 256)])

    def state_dict(self) -> dict:
        """The server's networks, their optimisers and its public-batch generator: all a hijack goes on from."""
        trainable = {n: p.detach() for n, p in self.pilot.named_parameters() if p.requires_grad}
        return {"pilot": trainable, "decoder": self.decoder.state_dict(),
                "discriminator": self.discriminator.state_dict(),
                "autoencoder_optimizer": self.autoencoder_optimizer.state_dict(),
                "discriminator_optimizer": self.discriminator_optimizer.state_dict(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> "FSHA":
        """Restore `state_dict` (after `fit`, which builds the networks)."""
        if not hasattr(self, "pilot"):
            raise RuntimeError("FSHA.fit(aux) must run before its state loads (it builds the networks)")
        width = state["decoder"]["project.weight"].shape[0]
        if width != self.options.decoder_width:
            raise ValueError(f"the saved FSHA decoder is {width} wide; build FSHA with decoder_width={width} "
                             f"(replay: -o decoder_width={width})")
        parameters = dict(self.pilot.named_parameters())
        with torch.no_grad():
            for name, value in state["pilot"].items():
                parameters[name].copy_(value)
        self.decoder.load_state_dict(state["decoder"])
        self.discriminator.load_state_dict(state["discriminator"])
        self.autoencoder_optimizer.load_state_dict(state["autoencoder_optimizer"])
        self.discriminator_optimizer.load_state_dict(state["discriminator_optimizer"])
        self.generator.set_state(state["generator"])
        return self

    def save_state(self, path: str | Path) -> None:
        """The server's state after a hijacked run, for `run` to decode its recording later."""
        torch.save(self.state_dict(), path)

    def load_state(self, path: str | Path) -> "FSHA":
        """Restore `save_state`'s file."""
        return self.load_state_dict(torch.load(path, weights_only=True))

    @classmethod
    def options_from_run(cls, config: SimConfig) -> dict:
        """The hijacking server's settings (strategies.adversarial builds it from these too)."""
        threat = config.threat
        return {"pretrain_steps": threat.fsha_pretrain_steps, "decoder_width": threat.fsha_decoder_width,
                "discriminator_steps": threat.fsha_discriminator_steps, "batch_size": threat.fsha_batch_size,
                "seed": threat.fsha_seed, "policy_aware": threat.fsha_policy_aware}

    def prepare_replay(self, run: ReplayContext) -> None:
        """The networks the hijacked run saved (`save_state` into `<run>/attacks/fsha.pt`): `fit`
        builds the networks and loads them instead of pre-training."""
        self.run_config = run.config
        path = run.folder / ATTACK_FOLDER / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"FSHA is active: decoding a run needs the server state the hijacked run saved with "
                f"FSHA.save_state at {path}; a run without the hijack has none"
            )
        self.saved_state = path

    def run(self, recording: Recording, truth: Truth | None = None) -> AttackResult:
        k, o = self.knowledge, self.options
        if o.adaptive and self.adapted_to is None:
            self.adapt_decoder(defenses_for_run(self.name, self.run_config, recording))
        spans = VisualSpans(k, k.first_cut).fit(self.aux) if fewer_visual_rows(recording.config) else None
        observations = visual_observations(recording, k, attack=self.name, spans=spans)
        if o.last_rounds:
            last = max(obs.entry.round for obs in observations)
            observations = [obs for obs in observations if obs.entry.round > last - o.last_rounds]
        images = self.reconstruct([obs.rows for obs in observations])
        result = AttackResult(self.name,
                              details={"observed_samples": len(observations), "adaptive_to": self.adapted_to},
                              outputs={"reconstructions": images})
        score = None if truth is None else score_images(observations, images, k, truth, self.aux, self.aux_images)
        if score is not None:
            result.metrics.update(score.metrics)
            result.outputs["targets"] = score.targets
        return result


register_attack(FSHA)
