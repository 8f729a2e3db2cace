"""Everything a client needs for a message: config, model, its data shard, its private state.

Building it (model, tokenizer, shard, vision features) is the same in every process,
so a warm process keeps it (`client_runtime`); what a client *learns* — its adapters,
optimiser state and step counter — lives only in its PrivateStore on disk and is
reloaded whenever the disk holds a newer snapshot than the process.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context

from pruning import VisualTokenSelector
from config import SimConfig, load_config
from training.batches import EncodedSample, encode_samples
from training.data import RunData
from training.model import PartyModel, load_party_model, make_optimizer
from training.selector import build_selector
from training.store import PrivateStore
from vlm.cuts import LayerSegment
from vlm.features import VisionFeatureCache
from vlm.lora import load_owner_state_dict, owner_lora_parameters, owner_state_dict

# The store part holding the step counter (the others are named after their owners).
PROGRESS = "progress"
# The segments a client trains and keeps, per paradigm (vlm.cuts owner names).
CLIENT_OWNERS = {"cl": ("all",), "fl": ("all",), "sl": ("client",), "usl": ("head", "tail")}


@dataclass
class ClientRuntime:
    config: SimConfig
    partition_id: int
    party: PartyModel
    tokenizer: Any
    train: list[EncodedSample]
    test: list[EncodedSample]
    features: VisionFeatureCache
    selector: VisualTokenSelector
    # Stamped benchmark: the patches holding each stamped image's mark (empty otherwise).
    marks: dict[str, tuple[int, ...]]
    store: PrivateStore
    owned: dict[str, LayerSegment]
    # The seeded adapters every party starts from (not learned, so not private state).
    initial_lora: dict[str, dict[str, torch.Tensor]]
    optimizers: dict[str, torch.optim.AdamW] = field(default_factory=dict)
    step: int = 0
    loaded_version: tuple[int, str] | None = None

    @property
    def model(self):
        return self.party.model

    def parameters(self, owner: str) -> list[torch.nn.Parameter]:
        return list(owner_lora_parameters(self.model, self.owned[owner]).values())

    def reset_private_state(self) -> None:
        """The run's starting point: seeded LoRA, fresh AdamW, step 0."""
        for owner, segment in self.owned.items():
            load_owner_state_dict(self.model, segment, self.initial_lora[owner])
        self.optimizers = {owner: make_optimizer(self.parameters(owner), self.config) for owner in self.owned}
        self.step = 0

    def sync_private_state(self) -> None:
        """Load the newest snapshot if this process does not hold it already."""
        version = self.store.version()
        if version is not None and version == self.loaded_version:
            return
        parts = self.store.load()
        if parts is None:
            self.reset_private_state()
        else:
            self.optimizers = {owner: make_optimizer(self.parameters(owner), self.config) for owner in self.owned}
            for owner, segment in self.owned.items():
                load_owner_state_dict(self.model, segment, parts[owner]["lora"])
                self.optimizers[owner].load_state_dict(parts[owner]["optim"])
            self.step = int(parts[PROGRESS]["step"])
        self.loaded_version = version

    def save_private_state(self, round_: int, owners: Iterable[str] | None = None) -> None:
        """Snapshot the adapters and AdamW of `owners` (default: all this client owns) and the step counter."""
        # The first snapshot must be complete: later ones start as links to it.
        owners = self.owned if owners is None or self.store.version() is None else owners
        parts: dict[str, Any] = {
            owner: {
                "lora": owner_state_dict(self.model, self.owned[owner]),
                "optim": self.optimizers[owner].state_dict(),
            }
            for owner in owners
        }
        parts[PROGRESS] = {"step": self.step}
        self.store.save(round_, parts)
        self.loaded_version = self.store.version()


_RUNTIMES: dict[tuple[str, int, str], ClientRuntime] = {}


def client_runtime(context: Context) -> ClientRuntime:
    """The runtime of this node for this run, built once per process."""
    config = load_config(context.run_config)
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", config.clients.count))
    if config.paradigm == "cl":
        # The one trainer holds all data, whichever node the server picked for it.
        partition_id = num_partitions = 0
    elif num_partitions != config.clients.count or not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"node has partition-id={partition_id} of num-partitions={num_partitions}, but the run config says "
            f"clients.count={config.clients.count}; start the federation with num-supernodes={config.clients.count}"
        )
    state_dir = str(
        context.node_config.get("state-dir") or config.run_folder() / "clients" / f"partition-{partition_id}"
    )
    key = (config.fingerprint(), partition_id, state_dir)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = build_runtime(config, partition_id, state_dir)
        _RUNTIMES[key].store.record_node(context.node_id)
    return _RUNTIMES[key]


def build_runtime(config: SimConfig, partition_id: int, state_dir: str | Path) -> ClientRuntime:
    data = RunData.build(config)
    party = load_party_model(config)
    tokenizer = data.tokenizer(party.bundle)
    train = encode_samples(data.train_shard(partition_id), tokenizer, party.instruction)
    test = encode_samples(data.test_shard(partition_id), tokenizer, party.instruction)
    store = PrivateStore(state_dir)
    features = VisionFeatureCache(party.model, party.bundle.preprocess_images)
    cached = store.path("vision-features.pt")
    if cached.exists():
        features.load(cached)
    missing = [item.sample for item in [*train, *test] if item.sample.image_id not in features]
    if missing:
        features.add(missing, progress=False)
        features.save(cached)
    owned = {segment.owner: segment for segment in party.segments if segment.owner in CLIENT_OWNERS[config.paradigm]}
    return ClientRuntime(
        config=config,
        partition_id=partition_id,
        party=party,
        tokenizer=tokenizer,
        train=train,
        test=test,
        features=features,
        marks=data.mark_patches(party.bundle.profile),
        selector=build_selector(
            config,
            tokenizer=tokenizer,
            samples=[item.sample for item in [*train, *test]],
            cache_path=store.path("pruning-inputs.pt"),
            device=party.device,
        ),
        store=store,
        owned=owned,
        initial_lora={owner: owner_state_dict(party.model, segment) for owner, segment in owned.items()},
    )
