"""Everything a client needs for a message: config, model, its data shard, its private state.

Building it (model, tokenizer, shard, vision features) is the same in every process,
so a warm process keeps it (`client_runtime`), parses the run config once, and holds
one frozen base for all the virtual clients it serves: each client has its own named
adapter set on it (vlm.lora) and its own AdamW, activated before every message.

What a client *learns* — adapters, optimiser state, step counter — is snapshotted
into its PrivateStore once per turn, at the turn's last message; in between, a warm
process holds it in memory (with the front's autograd graph, clients.split): a Ray actor
in simulation, the warm worker in deployment (clients.worker). A process that serves only
one message — deployment's `flwr-clientapp` with clients.warm_worker off — snapshots after
every message instead, and a process without the newest snapshot in memory reloads it
from disk.
"""

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context

from clients import ONE_MESSAGE_PER_PROCESS
from privacy import DefenseChain, OptionError
from privacy.dp import LOCAL, SGD, noise_multiplier
from privacy.dp_sgd import SampleLevelDP
from privacy.per_sample import LinearSampleGradients
from pruning import VisualTokenSelector
from config import ConfigError, SimConfig, load_config
from config.schema import dp_federation
from training import protocol
from training.batches import EncodedSample, encode_samples
from training.data import RunData
from training.defenses import build_defenses
from training.model import CLIENT, PartyModel, load_party_model, make_optimizer, party_owners
from training.selector import build_selector
from training.store import PrivateStore
from vlm.cuts import LayerSegment
from vlm.features import VisionFeatureCache
from vlm.lora import DEFAULT_ADAPTER, add_adapter, load_owner_state_dict, owner_lora_parameters, owner_state_dict
from vlm.segments import DecoderInputs

# The store part holding the step counter (the others are named after their owners).
PROGRESS = "progress"


@dataclass
class KeptFront:
    """A training step's front, from its forward message to its backward one: the packed
    activation at the first cut still in its autograd graph (as the defenses left it), the
    loss terms of LOSS-stage defenses (None: none), and the decoder inputs (labels
    included) that USL's tail step reuses."""

    step: int
    inputs: DecoderInputs
    rows: torch.Tensor
    defense_loss: torch.Tensor | None = None
    # Under DP-SGD: the forward's layer inputs, from which the backward reads each sample's gradient.
    samples: LinearSampleGradients | None = None


@dataclass
class ClientRuntime:
    config: SimConfig
    partition_id: int
    party: PartyModel
    tokenizer: Any
    train: list[EncodedSample]
    test: list[EncodedSample]
    # Each `test` row's position in the run's test split (training.data.RunData.test_all).
    test_positions: tuple[int, ...]
    features: VisionFeatureCache
    selector: VisualTokenSelector
    # The run's defenses at the cut (privacy.*), applied before anything reaches the wire.
    defenses: DefenseChain
    # Stamped benchmark: the patches holding each stamped image's mark (empty otherwise).
    marks: dict[str, tuple[int, ...]]
    store: PrivateStore
    owned: dict[str, LayerSegment]
    # This client's adapter set on the shared base; the base's "default" set keeps the
    # seeded start every party begins from and is never trained.
    adapter: str
    optimizers: dict[str, torch.optim.AdamW] = field(default_factory=dict)
    step: int = 0
    # The snapshot memory holds (None: the run's start), once `synced`.
    loaded_version: tuple[int, str] | None = None
    synced: bool = False
    # The round whose progress is in memory only (None: memory equals the newest snapshot).
    unsaved_round: int | None = None
    kept_front: KeptFront | None = None
    # DP-SGD (privacy.dp.mode = "sgd"): this client's noise multiplier and budget.
    dp_sgd: SampleLevelDP | None = None
    # Local DP (privacy.dp.mode = "local"): the noise multiplier of every update, calibrated once.
    local_dp_noise: float = 0.0
    _sample_gradients: dict[str, LinearSampleGradients] = field(default_factory=dict)

    def dp_generator(self, round_: int, segment: str) -> torch.Generator:
        """DP-SGD's noise for this client's current step on `segment`, seeded like the defenses'
        draws (privacy.seed, client, round, step), so a resumed step adds the same noise."""
        return self.defenses.seed_for(self.partition_id, round_, self.step).generator(f"dp_sgd:{segment}")

    def test_scores(self, first: int, scores: Iterable[float]) -> dict[str, Any]:
        """An evaluation score's metrics for the test rows from `first` on, scored `scores`: their sum
        and count, and each one's position in the run's test split and score (training.protocol.QUESTIONS)."""
        scores = [float(score) for score in scores]
        return {"correct": sum(scores), "count": float(len(scores)),
                protocol.QUESTIONS: list(self.test_positions[first : first + len(scores)]),
                protocol.QUESTION_SCORES: scores}

    @property
    def model(self):
        return self.party.model

    def activate(self) -> None:
        """Make this client's adapters the ones the shared base computes with."""
        # peft walks every module to switch; consecutive messages mostly come from one client.
        if self.model.active_adapter != self.adapter:
            self.model.set_adapter(self.adapter)

    def parameters(self, owner: str) -> list[torch.nn.Parameter]:
        return list(owner_lora_parameters(self.model, self.owned[owner], self.adapter).values())

    def sample_gradients(self, owner: str) -> LinearSampleGradients:
        """DP-SGD's reader of per-sample gradients for `owner`'s parameters, one per segment: finding
        their layers walks the whole model, a twentieth of a step when done at every step."""
        if owner not in self._sample_gradients:
            self._sample_gradients[owner] = LinearSampleGradients(self.model, self.parameters(owner))
        return self._sample_gradients[owner]

    def reset_private_state(self) -> None:
        """The run's starting point: seeded LoRA, fresh AdamW, step 0."""
        for segment in self.owned.values():
            initial = owner_state_dict(self.model, segment, DEFAULT_ADAPTER)
            load_owner_state_dict(self.model, segment, initial, self.adapter)
        self.optimizers = {owner: make_optimizer(self.parameters(owner), self.config) for owner in self.owned}
        self.step = 0

    def sync_private_state(self) -> None:
        """Load the newest snapshot if this process does not hold it already."""
        version = self.store.version()
        if self.synced and version == self.loaded_version:
            return
        parts = self.store.load()
        if parts is None:
            self.reset_private_state()
        else:
            self.optimizers = {owner: make_optimizer(self.parameters(owner), self.config) for owner in self.owned}
            for owner, segment in self.owned.items():
                load_owner_state_dict(self.model, segment, parts[owner]["lora"], self.adapter)
                self.optimizers[owner].load_state_dict(parts[owner]["optim"])
            self.step = int(parts[PROGRESS]["step"])
        self.loaded_version, self.synced = version, True
        self.unsaved_round, self.kept_front = None, None

    def begin_turn(self, committed_round: int) -> None:
        """A turn (re)starts from the server's last committed round. Progress held only in
        memory counts as the disk would have had it: kept if its round was committed (a
        faulted turn's steps), dropped for the snapshot on disk if not (a resumed run
        redoing that round)."""
        if self.unsaved_round is not None:
            if self.unsaved_round <= committed_round:
                self.save_private_state(self.unsaved_round)
            else:
                self.synced = False
        self.store.begin_round(committed_round)
        self.sync_private_state()

    def after_training_message(self, round_: int, owners: Iterable[str], *, end_of_turn: bool) -> None:
        """Snapshot once per turn, at its end; after every message where the process serves
        only one, saving only the `owners` that message changed."""
        if ONE_MESSAGE_PER_PROCESS:
            self.save_private_state(round_, owners)
        elif end_of_turn:
            self.save_private_state(round_)
        else:
            self.unsaved_round = round_

    def save_unsaved(self) -> None:
        """Snapshot the progress held only in memory, if any."""
        if self.unsaved_round is not None:
            self.save_private_state(self.unsaved_round)

    def save_private_state(self, round_: int, owners: Iterable[str] | None = None) -> None:
        """Snapshot the adapters and AdamW of `owners` (default: all this client owns) and the step counter."""
        # The first snapshot must be complete: later ones start as links to it.
        owners = self.owned if owners is None or self.store.version() is None else owners
        parts: dict[str, Any] = {
            owner: {
                "lora": owner_state_dict(self.model, self.owned[owner], self.adapter),
                "optim": self.optimizers[owner].state_dict(),
            }
            for owner in owners
        }
        parts[PROGRESS] = {"step": self.step}
        self.store.save(round_, parts)
        self.loaded_version = self.store.version()
        self.unsaved_round = None


_CONFIGS: dict[tuple, tuple[SimConfig, str]] = {}
_BASES: dict[str, PartyModel] = {}
_RUNTIMES: dict[tuple[str, int, str], ClientRuntime] = {}


def parsed_config(run_config: dict) -> tuple[SimConfig, str]:
    """The run config and its fingerprint, parsed once per process and content."""
    key = tuple(sorted(run_config.items()))
    if key not in _CONFIGS:
        config = load_config(run_config)
        _CONFIGS[key] = config, config.fingerprint()
    return _CONFIGS[key]


def _base_key(config: SimConfig) -> str:
    return json.dumps([asdict(config.model), config.paradigm, list(config.cuts)], sort_keys=True)


def shared_party_model(config: SimConfig) -> PartyModel:
    """The client party's model, one per process and model settings: every virtual client
    the process serves computes on this frozen base with its own adapter set."""
    key = _base_key(config)
    if key not in _BASES:
        _BASES[key] = load_party_model(config, CLIENT)
    return _BASES[key]


def client_state_dir(config: SimConfig, partition_id: int, node_dir: Any = None) -> Path:
    """Where a client keeps its private state: in the run folder, or under the node's state-dir.
    A node's state-dir serves every run it joins, so there each run keeps a folder of its own,
    named by its run name and settings (the same on resume, which may change only the resumable
    keys): one run never reads another's state."""
    if not node_dir:
        return config.run_folder() / "clients" / f"partition-{partition_id}"
    return Path(str(node_dir)).expanduser() / f"{config.output.name}-{config.fingerprint()[:12]}" / f"partition-{partition_id}"


def client_runtime(context: Context) -> ClientRuntime:
    """The runtime of this node for this run, built once per process, its adapters active."""
    config, fingerprint = parsed_config(context.run_config)
    partition_id = int(context.node_config.get(protocol.PARTITION_ID, 0))
    num_partitions = int(context.node_config.get("num-partitions", config.clients.count))
    if not config.paradigm_spec.wire:
        # The one trainer holds all data, whichever node the server picked for it.
        partition_id = num_partitions = 0
    elif num_partitions != config.clients.count or not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"node has partition-id={partition_id} of num-partitions={num_partitions}, but the run config says "
            f"clients.count={config.clients.count}; start the federation with num-supernodes={config.clients.count}"
        )
    state_dir = str(client_state_dir(config, partition_id, context.node_config.get("state-dir")))
    key = (fingerprint, partition_id, state_dir)
    if key not in _RUNTIMES:
        release_other_runs(config, fingerprint)
        _RUNTIMES[key] = build_runtime(config, partition_id, state_dir)
        _RUNTIMES[key].store.record_node(context.node_id)
    runtime = _RUNTIMES[key]
    runtime.activate()
    return runtime


def release_other_runs(config: SimConfig, fingerprint: str) -> None:
    """Free the runtimes of runs other than `fingerprint`, and the bases `config` does not
    compute on: a process that serves runs one after another (a sweep) would otherwise keep
    every run's adapters. Progress they hold only in memory is snapshotted first, so a
    later message of theirs rebuilds them from disk."""
    for key in [key for key in _RUNTIMES if key[0] != fingerprint]:
        runtime = _RUNTIMES.pop(key)
        runtime.save_unsaved()
        if runtime.model.active_adapter == runtime.adapter:
            runtime.model.set_adapter(DEFAULT_ADAPTER)
        # FL's clients share their set: the first of them to go takes it.
        if runtime.adapter in runtime.model.peft_config:
            runtime.model.delete_adapter(runtime.adapter)
    in_use = {id(runtime.party) for runtime in _RUNTIMES.values()}
    for key in [key for key, party in _BASES.items() if id(party) not in in_use and key != _base_key(config)]:
        del _BASES[key]


def snapshot_unsaved_progress() -> None:
    """Snapshot the progress every runtime of this process holds only in memory (a leaving worker)."""
    for runtime in _RUNTIMES.values():
        runtime.save_unsaved()


def build_runtime(config: SimConfig, partition_id: int, state_dir: str | Path) -> ClientRuntime:
    data = RunData.build(config)
    party = shared_party_model(config)
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
    owners = party_owners(config.paradigm_spec, CLIENT)
    owned = {segment.owner: segment for segment in party.segments if segment.owner in owners}
    # Named by what the runtime is for, so a rebuilt runtime (a cleared cache) reuses its set. An FL
    # client keeps nothing between messages (each starts from the server's adapters, with a fresh
    # AdamW), so the FL clients of a process share one set: hundreds of virtual clients cost one.
    holder = "" if config.paradigm_spec.averages_updates else f"|{partition_id}|{Path(state_dir).resolve()}"
    digest = hashlib.sha256(f"{config.fingerprint()}{holder}".encode()).hexdigest()
    adapter = f"client_{digest[:16]}"
    initial = {}
    for segment in owned.values():
        initial.update(owner_state_dict(party.model, segment, DEFAULT_ADAPTER))
    add_adapter(party.model, adapter, initial)
    return ClientRuntime(
        config=config,
        partition_id=partition_id,
        party=party,
        tokenizer=tokenizer,
        train=train,
        test=test,
        test_positions=tuple(int(position) for position in data.test_indices[partition_id]),
        features=features,
        marks=data.mark_patches(party.bundle.profile),
        selector=build_selector(
            config,
            tokenizer=tokenizer,
            samples=[item.sample for item in [*train, *test]],
            cache_path=store.path("pruning-inputs.pt"),
            device=party.device,
            model=party.model,
            instruction=party.instruction,
            pixel_values=features.sample_pixel_values,
        ),
        defenses=build_defenses(config),
        store=store,
        owned=owned,
        adapter=adapter,
        dp_sgd=sample_level_dp(config, len(train)),
        local_dp_noise=noise_multiplier(config.privacy.dp, dp_federation(config)) if config.privacy.dp.mode == LOCAL else 0.0,
    )


def sample_level_dp(config: SimConfig, samples: int) -> SampleLevelDP | None:
    """DP-SGD for a client holding `samples` training samples, over every step the run gives it."""
    if config.privacy.dp.mode != SGD:
        return None
    try:
        return SampleLevelDP(config.privacy.dp, samples, config.train.batch_size, config.train.rounds * config.train.steps_per_round)
    except OptionError as error:
        raise ConfigError(f"privacy.dp.{error.option}", error.value, error.allowed) from None
