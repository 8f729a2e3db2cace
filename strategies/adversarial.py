"""The server's threat model (run config `threat.model`), put around the honest strategies.

- none: an honest server.
- passive (FL, SL, USL), honest-but-curious: the run proceeds unchanged and a Recorder
  (attacks.recording) keeps, under the `threat.max_*` caps, what the server received —
  cut activations, returned gradients, FL updates — and what it sent that attacks
  replay: USL's activation at CB beside each gradient at CB, FL's global adapters each
  round. It sees only what the wire shows it, so nothing else can get in.
- active-fsha (SL, USL): recorded as passive, and the server replaces its segment with
  FSHA's networks (attacks.fsha), trained on public data when the run starts. The
  strategy runs with an `FSHAHijack` injected (strategies.split.CutHijack): each
  training activation at the first cut is answered with the discriminator's gradient,
  so the clients' own optimisers pull their fronts into the pilot's feature space.
  Under USL the tail still gets the (frozen) body's rows and returns its gradient, so
  the server sees what crosses the cuts and nothing more. The hijack's state goes into
  every checkpoint (a resumed run goes on hijacking) and into `<run>/attacks/fsha.pt`,
  from which `python -m attacks run RUN fsha` decodes the recorded activations.

The run folder says which threat model ran: `status.json` (`threat_model`), and
`threat.model` in `config.json` and in the recording's header.
"""

import os
from typing import Any

import torch

from attacks.fsha import FSHA, STATE_FILE
from attacks.observations import VisualSpans, fewer_visual_rows
from attacks.recording import Recorder
from attacks.context import ATTACK_FOLDER
from attacks.replay import knowledge_for_run
from config import SimConfig
from strategies.callbacks import RunFolder
from training.data import RunData
from training.model import PartyModel
from wire import Wire


def subscribe_recorder(config: SimConfig, wire: Wire, folder: RunFolder) -> None:
    """Under a passive or active threat model, subscribe the run's recorder to `wire`:
    everything the server accepts, and the payloads it sends that strategies name."""
    if not config.threat_spec.records:
        return
    make = Recorder.factory(max_bytes=config.threat.max_bytes, max_samples=config.threat.max_samples or None,
                            rounds=config.recorded_rounds)
    wire.subscribe(make(config, folder), sent=True)


class FSHAHijack:
    """FSHA's server side as a `CutHijack` for SLStrategy/USLStrategy, and a RunCallback
    that writes its state to `<run>/attacks/fsha.pt` after every round."""

    def __init__(self, config: SimConfig, party: PartyModel, folder: RunFolder, *, pretrain: bool = True) -> None:
        threat = config.threat
        # The clients' data is read only to keep their images out of the attacker's public data.
        aux = RunData.build(config).auxiliary(threat.aux_limit)
        # The server's own model is the public one: a hijacking server never trains its adapters.
        knowledge = knowledge_for_run(config, party)
        options = FSHA.options_from_run(config) | {"progress": False}
        # On resume the checkpoint's state replaces the networks: pre-training them would be thrown away.
        if not pretrain:
            options["pretrain_steps"] = 0
        attack = FSHA(knowledge, **options)
        # The server knows the run's config: with fsha_policy_aware it prunes as the clients' policy does.
        attack.run_config = config
        self.attack = attack.fit(aux)
        # Under pruning (or an edge that removes tokens) each sample's visual-token count is
        # unknown to the server; it tells the visual rows from the text rows as the replayed attack does.
        uncounted = fewer_visual_rows(config.to_flat())
        self.spans = VisualSpans(knowledge, knowledge.first_cut).fit(aux) if uncounted else None
        self.path = folder.path / ATTACK_FOLDER / STATE_FILE

    def first_cut_gradient(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        # Detached: the USL body ran on these very rows and left them requiring grad.
        return self.attack.gradients_for_packed(rows.detach(), lengths, self.spans)

    def state_dict(self) -> dict[str, Any]:
        return self.attack.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.attack.load_state_dict(state)

    def on_round_end(self, round_: int, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        self.attack.save_state(partial)
        os.replace(partial, self.path)
