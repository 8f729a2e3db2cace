"""What a replay hands an attack besides the recording: the run it came from.

`ReplayContext` is the recorded run as `Attack.prepare_replay` sees it; `final_model`
is a client's fine-tuned model after the run (what a query attack gets black-box
access to). Attacks and the replay driver both import it, so neither imports the other.
"""

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from attacks.knowledge import AttackerKnowledge
from config import SimConfig
from training.store import PrivateStore
from vlm.cuts import split_layers
from vlm.lora import load_owner_state_dict

ATTACK_FOLDER = "attacks"


@dataclass
class ReplayContext:
    """A recorded run as an attack's `prepare_replay` sees it."""

    folder: Path
    config: SimConfig
    knowledge: AttackerKnowledge
    # The client whose fine-tuned model a query attack targets.
    partition: int = 0


def accounted_epsilon(run: ReplayContext) -> dict[str, float]:
    """{"accountant_epsilon": ε} as the run's status reports what its accountant spent; {} for a
    run without one: what an audit's bound is read against."""
    status = run.folder / "status.json"
    spent = json.loads(status.read_text()).get("privacy_spent", {}) if status.exists() else {}
    return {"accountant_epsilon": spent["dp_epsilon"]} if "dp_epsilon" in spent else {}


def final_model(run: ReplayContext) -> nn.Module:
    """Client `run.partition`'s fine-tuned model after the last committed round: the server's
    adapters from its checkpoint, the client's from its private store. Query attacks get
    black-box access to it; they read only its outputs."""
    config, folder = run.config, run.folder
    committed = folder / "committed.json"
    if not committed.exists():
        raise FileNotFoundError(f"{folder} has no committed round: the run never finished one")
    round_ = json.loads(committed.read_text())["round"]
    checkpoint = torch.load(folder / "checkpoints" / f"round-{round_:06d}.pt", weights_only=True)
    store = PrivateStore(folder / "clients" / f"partition-{run.partition}").load() or {}
    model = copy.deepcopy(run.knowledge.model)
    paradigm = config.paradigm_spec
    # The server's checkpoint holds FedAvg's global adapters, or those of the server's own segment.
    server_owners = paradigm.client_owners if paradigm.averages_updates else paradigm.server_owners
    for segment in split_layers(run.knowledge.num_layers, config.cuts):
        if segment.owner in server_owners:
            state = checkpoint["arrays"] if paradigm.averages_updates else checkpoint["lora"]
        elif segment.owner in store:
            state = store[segment.owner]["lora"]
        else:
            raise FileNotFoundError(
                f"client partition {run.partition}'s adapters for {segment.owner!r} are not in {folder}/clients/ "
                "(a node with its own state-dir keeps them there)"
            )
        load_owner_state_dict(model, segment, state)
    return model.eval()
