"""The simulation config: one structured schema, validated once before any model loads.

Flower hands apps a flat run config (`[tool.flwr.app.config]`, dotted keys, overridable
with `flwr run DIR --run-config 'key=value'`). `load_config` turns it into a typed,
nested `SimConfig` and checks every value against what is allowed, so a typo fails in
milliseconds with one message naming the key, the value and the allowed values —
never after minutes of model loading.
"""

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from config.threats import THREAT_MODELS, ThreatModel
from privacy import (
    EDGE, LOSS, STAGES, OptionError, client_stages, defense_class, defense_names, parse_defense_names, stage_paradigms,
)
from privacy.dp import CENTRAL, CENTRAL_CLIENT_CLIPPING, MODES, OFF, SGD, DPOptions, Federation, mode_paradigms, noise_multiplier
from privacy.dp_mtv import DISTRIBUTED, PRIVATE, DPMTVOptions, chunk_counts, sum_noise_std
from privacy.secagg import SecAggOptions
from pruning import POLICIES, get_policy, get_pruning_profile, policy_names, policy_options
from vlm.paradigms import PARADIGMS, Paradigm
from vlm.profiles import get_profile, profile_names
from vlm.task_vectors import profile_head_layout
from vqa import dataset_names, get_adapter
from wire import WIRE_DTYPES

PARTITIONS = ("iid", "dirichlet")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
MODEL_STAGES = ("base", "vqa", "random")
# Keys that may hold inf: a task vector's epsilon (inf: non-private MTV).
INFINITE_KEYS = ("privacy.mtv.epsilon",)
# Keys that may change when a run resumes (a longer run, a different timeout).
RESUMABLE_KEYS = ("train.rounds", "faults.timeout_s", "output.resume", "clients.warm_worker", "clients.worker_idle_s")


class ConfigError(ValueError):
    """A run-config value that is not allowed; the message names key, value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"run config {key}={value!r} is not allowed; allowed: {allowed}")


@dataclass
class ModelConfig:
    profile: str = "mini"
    # A local checkpoint folder (or a hub id already in the local HF cache) for real weights.
    source: str = ""
    # mini: "base" is the starting point every paradigm fine-tunes ("vqa": the central
    # reference). "random": the profile's architecture with random weights (costs, tests).
    stage: str = "base"
    dtype: str = "fp32"
    device: str = "auto"
    # 0: the profile's rank.
    lora_rank: int = 0
    seed: int = 0


@dataclass
class SplitConfig:
    # 0: the profile's default cut(s).
    sl_cut: int = 0
    cut_a: int = 0
    cut_b: int = 0


@dataclass
class DataConfig:
    dataset: str = "easyvqa"
    source: str = ""
    train_split: str = "train"
    test_split: str = "test"
    # 0: every row.
    train_limit: int = 0
    test_limit: int = 0
    partition: str = "iid"
    alpha: float = 0.5
    seed: int = 0
    # Membership audit: per client, this many rows of the training split no client holds get a
    # random plausible answer (canaries), and a fair coin puts each in the client's training data
    # or leaves it out (Steinke et al.'s one-run audit); attacks' membership truth is then these.
    canaries: int = 0
    # Comma-separated question kinds (e.g. "location,relation"): the run's rows, test and canaries
    # and the attacker's public rows alike, are drawn from those kinds only; "": every kind.
    question_kinds: str = ""

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(kind.strip() for kind in self.question_kinds.split(",")) if self.question_kinds else ()


# How an FL round draws its clients (clients.sampling).
FIXED, POISSON = "fixed", "poisson"
SAMPLINGS = (FIXED, POISSON)


@dataclass
class ClientsConfig:
    count: int = 2
    # FL only: share of clients sampled per round.
    fraction_train: float = 1.0
    # FL only. fixed: fraction_train of the clients each round, drawn without replacement.
    # poisson: each client by its own coin of probability fraction_train (cross-device FL), the
    # round averaged over the expected cohort (count · fraction_train, a whole number), so DP-FedAvg's
    # accountant may amplify by sampling.
    sampling: str = "fixed"
    # Deployment: a SuperNode hands each message to a worker that keeps this run's client
    # resident (clients.worker); false rebuilds the client in every message's own process.
    warm_worker: bool = True
    # Seconds that worker waits for its node's next message before it snapshots and leaves.
    worker_idle_s: float = 900.0

    @property
    def sampled(self) -> int:
        """The clients an FL round trains: `fraction_train` of them, at least one (poisson: the
        expected cohort)."""
        if self.sampling == POISSON:
            return round(self.count * self.fraction_train)
        return max(1, int(self.count * self.fraction_train))


@dataclass
class TrainConfig:
    rounds: int = 3
    # Optimiser steps per client per round: T_l in FL, the turn length in SL/USL, steps in CL.
    steps_per_round: int = 10
    batch_size: int = 8
    # CL only: micro-batches accumulated per optimiser step.
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class EvalConfig:
    # Evaluate after every `every` rounds (and after the last); 0: never.
    every: int = 1
    batch_size: int = 32
    max_new_tokens: int = 4


@dataclass
class WireConfig:
    dtype: str = "fp32"


@dataclass
class PruningShared:
    # A registered policy (pruning.policies; docs/pruning.md lists them): off, fixed, dtp, oracle, random, dart, …
    policy: str = "off"
    # Fusion c = alpha·u − beta·s; alpha = 0 ranks by privacy alone (the paper's best medical setting).
    alpha: float = 1.0
    beta: float = 1.0
    # The folder "prepare DTP" wrote (dtp.pt, oracle.pt); "": none (fixed then ranks with an untrained scorer).
    artifacts: str = ""
    # Seed of that untrained scorer, and of policy "random"'s draws.
    seed: int = 0
    # Real encoders (llava-1.5-7b): local folders or hub ids in the HF cache; "": the profile's hub ids.
    text_source: str = ""
    dino_source: str = ""


def _policy_option_fields() -> list[tuple[str, type, Any]]:
    """Every registered policy's own options, as flat `pruning.<option>` keys with the policy's
    default (each explained in its Options dataclass). Policies that share an option (the
    budget `ratio`) share its key, so they must agree on its default."""
    found: dict[str, tuple[str, type, Any]] = {}
    for policy in POLICIES:
        defaults = policy.Options()
        for option in fields(policy.Options):
            default = getattr(defaults, option.name)
            if option.name in found and found[option.name][2].default != default:
                raise TypeError(f"pruning policies disagree on the default of pruning.{option.name}: "
                                f"{found[option.name][2].default!r} and {default!r} (policy {policy.name})")
            found.setdefault(option.name, (option.name, option.type, field(default=default)))
    return list(found.values())


# The shared settings and every policy's own (a policy's module is all it takes to add one).
PruningConfig = make_dataclass("PruningConfig", _policy_option_fields(), bases=(PruningShared,))


# Defenses at the cut (privacy/): `defenses` names the active ones in order, comma-separated
# ("noise,sparsify"; "": none); `privacy.<name>.<option>` sets each registered defense's
# options (its Options dataclass owns the defaults); `seed` seeds their random draws, which
# are also keyed by client, round and step. `privacy.dp.<option>`: differential privacy for
# FedAvg with its budget (privacy.dp), the same seed keying its noise; `privacy.secagg.<option>`:
# FedAvg's training rounds through SecAgg+ (privacy.secagg); `privacy.mtv.<option>`: federated DP-MTV
# (paradigm mtv; privacy.dp_mtv).
PrivacyConfig = make_dataclass(
    "PrivacyConfig",
    [("defenses", str, field(default="")), ("seed", int, field(default=0)),
     ("dp", DPOptions, field(default_factory=DPOptions)), ("secagg", SecAggOptions, field(default_factory=SecAggOptions)),
     ("mtv", DPMTVOptions, field(default_factory=DPMTVOptions))]
    + [(name, defense_class(name).Options, field(default_factory=defense_class(name).Options)) for name in defense_names()],
)


@dataclass
class FaultsConfig:
    # Longest wait for one reply; a client that misses it loses its turn.
    timeout_s: float = 600.0


@dataclass
class ThreatConfig:
    # none: an honest server. passive: honest-but-curious, it records what it receives (and
    # what it sends that attacks replay) into <run>/recording/. active-fsha: it also replaces
    # its own segment with FSHA's networks and returns their gradient at the first cut.
    model: str = "none"
    # The recording's caps: bytes of stored tensors, and samples (0: no sample cap).
    max_bytes: int = 2 * 1024**3
    max_samples: int = 0
    # The rounds whose transfers the recording stores, comma-separated ("1,10,20"), each under
    # its own caps, so an attack can be replayed at several points of training (python -m
    # attacks run --round); "": every round from the first until the caps are reached.
    record_rounds: str = ""
    # The attacker's public data: rows of this split of data.dataset whose images no client
    # trains or scores on (also what `python -m attacks run` trains on).
    aux_split: str = "test"
    aux_limit: int = 512
    # FSHA: pilot/decoder autoencoder steps on the public data before the first hijacked step,
    # discriminator updates per hijacked step, decoder width, public batch size, networks' seed.
    fsha_pretrain_steps: int = 500
    fsha_discriminator_steps: int = 3
    fsha_decoder_width: int = 128
    fsha_batch_size: int = 32
    fsha_seed: int = 0
    # FSHA's pilot prunes its public images with the run's own pruning policy (the server knows it).
    fsha_policy_aware: bool = False
    # FL only: the server audits the run with this many canary clients in update space, each in
    # the federation by a fair coin, whose update is the clipping norm (privacy.dp.clip) on one
    # adapter coordinate (attacks.update_canaries; 0: no audit). Their share of the adapters' change
    # is the audit's signal, and they cost the model what such clients would.
    update_canaries: int = 0


@dataclass
class OutputConfig:
    # Run folders go to root/name; "" for root: ~/qpriv-runs.
    root: str = ""
    name: str = MISSING
    # Continue from the run folder's last checkpoint when it exists.
    resume: bool = True


@dataclass
class SimConfig:
    paradigm: str = "usl"
    model: ModelConfig = field(default_factory=ModelConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    data: DataConfig = field(default_factory=DataConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    threat: ThreatConfig = field(default_factory=ThreatConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @property
    def paradigm_spec(self) -> Paradigm:
        """The registered paradigm `paradigm` names (vlm.paradigms)."""
        return PARADIGMS.get(self.paradigm)

    @property
    def threat_spec(self) -> ThreatModel:
        """The registered threat model `threat.model` names (config.threats)."""
        return THREAT_MODELS.get(self.threat.model)

    @property
    def client_layers(self) -> int:
        """The decoder layers a client runs before the first cut (all of them where nothing is cut)."""
        return self.cuts[0] if self.cuts else get_profile(self.model.profile).num_layers

    @property
    def recorded_rounds(self) -> tuple[int, ...] | None:
        """threat.record_rounds as round numbers (None: every round until the caps)."""
        text = self.threat.record_rounds.strip()
        return tuple(sorted({int(part) for part in text.split(",")})) if text else None

    @property
    def cuts(self) -> tuple[int, ...]:
        """The decoder cuts of this paradigm: () for CL/FL, (C,) for SL, (CA, CB) for USL."""
        return self.paradigm_spec.cut_layers(self.split.sl_cut, (self.split.cut_a, self.split.cut_b))

    def run_folder(self) -> Path:
        """Where this run's folder lives (and, by default, its clients' private state)."""
        root = Path(self.output.root).expanduser() if self.output.root else Path.home() / "qpriv-runs"
        return root / self.output.name

    def to_flat(self) -> dict[str, Any]:
        # asdict, not OmegaConf.structured: the values are already typed (load_config built them), and
        # a structured config costs 0.1 s, which sweeps pay for every point they validate.
        return _flatten(asdict(self))

    def fingerprint(self, *, ignore: tuple[str, ...] = RESUMABLE_KEYS) -> str:
        kept = {key: value for key, value in self.to_flat().items() if key not in ignore}
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _choice(key: str, value: Any, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, ", ".join(allowed))


def _at_least(key: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ConfigError(key, value, f">= {minimum}")


@cache
def _structured_defaults() -> DictConfig:
    # Building the structured config walks every nested dataclass (about 60 ms); a copy of a
    # built one costs a third of that, and sweeps and tests load hundreds of configs.
    return OmegaConf.structured(SimConfig)


@cache
def _flat_defaults() -> dict[str, Any]:
    return _flatten(OmegaConf.to_container(_structured_defaults()))


def load_config(run_config: Mapping[str, Any]) -> SimConfig:
    """A validated SimConfig from Flower's flat run config (dotted keys)."""
    base = copy.deepcopy(_structured_defaults())
    defaults = _flat_defaults()
    for key, value in run_config.items():
        # An app's run config declares every key, mostly at its default: setting those again costs
        # OmegaConf most of a load (a sweep validates hundreds), and changes nothing.
        if key in defaults and type(value) is type(defaults[key]) and value == defaults[key]:
            continue
        try:
            OmegaConf.update(base, key, value, merge=False, force_add=False)
        except OmegaConfBaseException as error:
            reason = str(error).splitlines()[0]
            if "not in" in reason:
                known = ", ".join(sorted(_flatten(OmegaConf.to_container(base))))
                raise ConfigError(key, value, f"one of the known keys: {known}") from None
            raise ConfigError(key, value, f"a value of the key's type ({reason})") from None
    if OmegaConf.is_missing(base.output, "name"):
        raise ConfigError("output.name", None, "a non-empty run name (the run folder's name)")
    config: SimConfig = OmegaConf.to_object(base)
    validate(config)
    return config


def validate(config: SimConfig) -> None:
    """Check every value; fills the profile-default cuts and LoRA rank in place."""
    # inf and nan pass every comparison below the wrong way (nan <= 0 is false): none is a setting.
    for key, value in config.to_flat().items():
        if isinstance(value, float) and not math.isfinite(value) and not (key in INFINITE_KEYS and value == math.inf):
            raise ConfigError(key, value, "a finite number")
    _choice("paradigm", config.paradigm, PARADIGMS.names())
    paradigm = config.paradigm_spec
    _choice("model.profile", config.model.profile, profile_names())
    profile = get_profile(config.model.profile)
    _choice("model.stage", config.model.stage, MODEL_STAGES)
    _choice("model.dtype", config.model.dtype, COMPUTE_DTYPES)
    _choice("model.device", config.model.device, DEVICES)
    _at_least("model.lora_rank", config.model.lora_rank, 0)
    if config.model.lora_rank == 0:
        config.model.lora_rank = profile.lora_rank
    layers = profile.num_layers
    split = config.split
    split.sl_cut = split.sl_cut or profile.sl_cut
    split.cut_a = split.cut_a or profile.usl_cuts[0]
    split.cut_b = split.cut_b or profile.usl_cuts[1]
    if not 0 < split.sl_cut < layers:
        raise ConfigError("split.sl_cut", split.sl_cut, f"an integer in [1, {layers - 1}] ({profile.name} has {layers} layers)")
    if not 0 < split.cut_a < layers - 1:
        raise ConfigError("split.cut_a", split.cut_a, f"an integer in [1, {layers - 2}] with cut_a < cut_b")
    if not split.cut_a < split.cut_b < layers:
        raise ConfigError(
            "split.cut_b", split.cut_b, f"an integer in [{split.cut_a + 1}, {layers - 1}] (cut_a={split.cut_a} < cut_b < {layers})"
        )
    _choice("data.dataset", config.data.dataset, dataset_names())
    splits = get_adapter(config.data.dataset).splits
    _choice("data.train_split", config.data.train_split, splits)
    _choice("data.test_split", config.data.test_split, splits)
    if config.data.test_split == config.data.train_split:
        raise ConfigError("data.test_split", config.data.test_split, f"a split other than data.train_split: "
                          f"{', '.join(s for s in splits if s != config.data.train_split)} (scoring on training rows "
                          "measures memory, not accuracy)")
    _choice("data.partition", config.data.partition, PARTITIONS)
    _at_least("data.train_limit", config.data.train_limit, 0)
    _at_least("data.test_limit", config.data.test_limit, 0)
    _at_least("clients.count", config.clients.count, 1)
    for key in ("train_limit", "test_limit"):
        limit = getattr(config.data, key)
        if 0 < limit < config.clients.count:
            raise ConfigError(f"data.{key}", limit, f"0 (every row) or at least clients.count={config.clients.count} "
                              "rows (each client needs a share)")
    _at_least("data.canaries", config.data.canaries, 0)
    if config.data.canaries and not config.data.train_limit:
        raise ConfigError("data.canaries", config.data.canaries, "0 unless data.train_limit > 0 (the canaries are "
                          "rows of the training split beyond the clients' train_limit)")
    if config.data.alpha <= 0:
        raise ConfigError("data.alpha", config.data.alpha, "> 0")
    kinds = config.data.kinds
    if "" in kinds or len(set(kinds)) != len(kinds):
        raise ConfigError("data.question_kinds", config.data.question_kinds,
                          '"" (every kind) or distinct question kinds separated by commas, e.g. "location,relation"')
    if not paradigm.wire and config.clients.count != 1:
        raise ConfigError("clients.count", config.clients.count,
                          f"1 for paradigm {config.paradigm} (one trainer holds all data)")
    if not 0 < config.clients.fraction_train <= 1:
        raise ConfigError("clients.fraction_train", config.clients.fraction_train, "a share in (0, 1]")
    _check_sampling(config)
    if not config.clients.worker_idle_s > 0:
        raise ConfigError("clients.worker_idle_s", config.clients.worker_idle_s, "> 0 seconds")
    for key in ("rounds", "steps_per_round", "batch_size", "grad_accum"):
        _at_least(f"train.{key}", getattr(config.train, key), 1)
    if paradigm.wire and config.train.grad_accum != 1:
        single_trainer = "/".join(p.name for p in PARADIGMS if not p.wire)
        raise ConfigError("train.grad_accum", config.train.grad_accum, f"1 unless paradigm={single_trainer}")
    if not config.train.lr > 0:
        raise ConfigError("train.lr", config.train.lr, "> 0")
    _at_least("train.weight_decay", config.train.weight_decay, 0)
    _at_least("eval.every", config.eval.every, 0)
    _at_least("eval.batch_size", config.eval.batch_size, 1)
    _at_least("eval.max_new_tokens", config.eval.max_new_tokens, 1)
    _choice("wire.dtype", config.wire.dtype, sorted(WIRE_DTYPES))
    _validate_pruning(config.pruning, profile.name, config.client_layers)
    _validate_privacy(config)
    _validate_threat(config)
    if not config.faults.timeout_s > 0:
        raise ConfigError("faults.timeout_s", config.faults.timeout_s, "> 0 seconds")
    if not config.output.name or "/" in config.output.name:
        raise ConfigError("output.name", config.output.name, "a non-empty folder name without '/'")


def _validate_threat(config: SimConfig) -> None:
    threat = config.threat
    _choice("threat.model", threat.model, THREAT_MODELS.names())
    paradigm = config.paradigm_spec
    if not config.threat_spec.applies_to(paradigm):
        raise ConfigError(
            "threat.model", threat.model, f"a threat model of paradigm {config.paradigm}: "
            + ", ".join(model.name for model in THREAT_MODELS if model.applies_to(paradigm))
        )
    _at_least("threat.max_bytes", threat.max_bytes, 0)
    _at_least("threat.max_samples", threat.max_samples, 0)
    if threat.record_rounds.strip():
        parts = [part.strip() for part in threat.record_rounds.split(",")]
        if not all(part.isdigit() and int(part) >= 1 for part in parts):
            raise ConfigError("threat.record_rounds", threat.record_rounds,
                              'round numbers >= 1, comma-separated ("1,10,20"), or "" for every round')
    _choice("threat.aux_split", threat.aux_split, get_adapter(config.data.dataset).splits)
    for key in ("aux_limit", "fsha_pretrain_steps", "fsha_discriminator_steps", "fsha_decoder_width", "fsha_batch_size"):
        _at_least(f"threat.{key}", getattr(threat, key), 1)
    _at_least("threat.update_canaries", threat.update_canaries, 0)
    if threat.update_canaries:
        _check_update_canaries(config)
    # The hijack trains on public data before the first step: a split the clients hold whole leaves none.
    client_splits = {config.data.train_split: "train_limit", config.data.test_split: "test_limit"}
    limit_key = client_splits.get(threat.aux_split)
    if config.threat_spec.hijacks and limit_key and getattr(config.data, limit_key) == 0:
        raise ConfigError(
            f"data.{limit_key}", 0, f"> 0 under threat.model={threat.model}: the attacker's public data is the rest of "
            f"the {threat.aux_split!r} split (threat.aux_split), and 0 gives all of it to the clients"
        )


# The DP modes that noise the round's average at a fixed clipping norm, or add nothing: what poisson
# sampling's accounting and the update canaries (a client's update of exactly that norm) assume.
FIXED_NORM_DP_MODES = (OFF, CENTRAL, CENTRAL_CLIENT_CLIPPING)


def _check_sampling(config: SimConfig) -> None:
    clients = config.clients
    _choice("clients.sampling", clients.sampling, SAMPLINGS)
    if clients.sampling != POISSON:
        return
    if config.paradigm != "fl":
        raise ConfigError("clients.sampling", clients.sampling, f"fixed for paradigm {config.paradigm} (only FL samples "
                          "its clients)")
    expected = clients.count * clients.fraction_train
    if not (clients.fraction_train < 1 and abs(expected - round(expected)) < 1e-9 and round(expected) >= 1):
        raise ConfigError("clients.fraction_train", clients.fraction_train,
                          f"a share below 1 of clients.count={clients.count} that is a whole number of clients (the "
                          "expected cohort poisson sampling averages over)")
    if config.privacy.secagg.enabled:
        raise ConfigError("clients.sampling", clients.sampling, "fixed under privacy.secagg.enabled (SecAgg+'s "
                          "thresholds are set for a known cohort)")
    if config.privacy.dp.mode not in FIXED_NORM_DP_MODES:
        raise ConfigError("clients.sampling", clients.sampling, f"fixed under privacy.dp.mode={config.privacy.dp.mode}; "
                          f"poisson sampling is accounted for the modes {', '.join(FIXED_NORM_DP_MODES)}")


def _check_update_canaries(config: SimConfig) -> None:
    value = config.threat.update_canaries
    if config.paradigm != "fl":
        raise ConfigError("threat.update_canaries", value, f"0 for paradigm {config.paradigm} (canary clients join "
                          "FedAvg's average; split runs are audited with data.canaries)")
    if config.privacy.secagg.enabled:
        raise ConfigError("threat.update_canaries", value, "0 under privacy.secagg.enabled (a canary client is no "
                          "SecAgg+ node, and the server sees no round's clients one by one)")
    if config.privacy.dp.mode not in FIXED_NORM_DP_MODES:
        raise ConfigError("threat.update_canaries", value, f"0 under privacy.dp.mode={config.privacy.dp.mode}; canaries "
                          f"audit the modes {', '.join(FIXED_NORM_DP_MODES)} (a canary's update is the fixed clipping norm, "
                          "noised as the server noises)")
    _at_least("threat.update_canaries", value, 2)


def _validate_privacy(config: SimConfig) -> None:
    names = parse_defense_names(config.privacy.defenses)
    for name in names:
        _choice("privacy.defenses", name, defense_names())
    if len(set(names)) != len(names):
        raise ConfigError("privacy.defenses", config.privacy.defenses, "each defense named once (one set of options each)")
    for name in names:
        stage = defense_class(name).stage
        if stage not in client_stages(config.paradigm_spec):
            raise ConfigError(
                "privacy.defenses", config.privacy.defenses,
                f"defenses a {config.paradigm} client can apply: {name} acts on {STAGES[stage][0]} "
                f"({', '.join(stage_paradigms(stage))} only)",
            )
    # Every defense's options, active or not: each is a key, and a typo must not wait for its use.
    for name in defense_names():
        try:
            getattr(config.privacy, name).validate()
        except OptionError as error:
            raise ConfigError(f"privacy.{name}.{error.option}", error.value, error.allowed) from None
    _validate_federated_privacy(config)
    _validate_mtv(config)
    # The active EDGE defenses against the profile's tower, before it loads.
    profile = get_profile(config.model.profile)
    edge = [name for name in names if defense_class(name).stage == EDGE]
    if edge and get_policy(config.pruning.policy).merges:
        raise ConfigError("pruning.policy", config.pruning.policy,
                          f"a policy that sends its kept rows unmerged with {', '.join(edge)} in privacy.defenses "
                          "(the vision edge sends its own tokens by position; a merged row has none)")
    for name in names:
        if defense_class(name).stage != EDGE:
            continue
        try:
            defense_class(name)(getattr(config.privacy, name)).check(profile.num_patches, profile.vision_blocks)
        except OptionError as error:
            raise ConfigError(f"privacy.{name}.{error.option}", error.value, error.allowed) from None


def dp_federation(config: SimConfig) -> Federation:
    return Federation(clients=config.clients.count, sampled=config.clients.sampled, rounds=config.train.rounds,
                      poisson=config.clients.sampling == POISSON)


def _validate_federated_privacy(config: SimConfig) -> None:
    """privacy.dp's and privacy.secagg's options, then what they promise against this run: its
    paradigm, its clients (delta, shares) and its rounds (a target epsilon is calibrated here,
    before anything loads)."""
    dp, secagg = config.privacy.dp, config.privacy.secagg
    try:
        dp.validate()
        if config.paradigm not in dp.paradigms:
            allowed = [mode for mode in MODES if config.paradigm in mode_paradigms(mode)]
            raise OptionError("mode", dp.mode, f"a mode of paradigm {config.paradigm}: {', '.join(allowed)} "
                              f"({dp.mode} applies to {', '.join(dp.paradigms)})")
        if dp.mode == SGD:
            _check_dp_sgd(config)
        noise_multiplier(dp, dp_federation(config))
    except OptionError as error:
        raise ConfigError(f"privacy.dp.{error.option}", error.value, error.allowed) from None
    try:
        secagg.validate()
        if secagg.enabled:
            if not config.paradigm_spec.aggregates:
                raise OptionError("enabled", secagg.enabled, f"false for paradigm {config.paradigm} (SecAgg+ sums FedAvg "
                                  "updates and task-vector shares)")
            secagg.resolved(config.clients.sampled, secagg_weight(config))
    except OptionError as error:
        raise ConfigError(f"privacy.secagg.{error.option}", error.value, error.allowed) from None
    if secagg.enabled and dp.server_clips:
        raise ConfigError("privacy.dp.mode", dp.mode, "off, local or central-client-clipping under privacy.secagg.enabled "
                          "(the server cannot clip updates it only sees summed)")


def secagg_weight(config: SimConfig) -> float:
    """What a client weights its SecAgg+ vector by, at most: its examples in an FL round, its chunks in MTV."""
    if not config.paradigm_spec.trains:
        return float(max(chunk_counts(config.privacy.mtv.chunks, config.clients.count)))
    return float(config.train.steps_per_round * config.train.batch_size)


def _validate_mtv(config: SimConfig) -> None:
    """privacy.mtv's options, and under paradigm mtv what the federation can deliver: each client's
    share of the chunks from its rows, delta below one over the private rows, a noise site that
    keeps the server from any single client's sum, and nothing of the training paradigms."""
    options = config.privacy.mtv
    try:
        options.validate()
    except OptionError as error:
        raise ConfigError(f"privacy.mtv.{error.option}", error.value, error.allowed) from None
    profile = get_profile(config.model.profile)
    try:
        layout = profile_head_layout(profile, options.layer_indices)
    except ValueError:
        raise ConfigError("privacy.mtv.layers", options.layers, f"decoder layers in [0, {profile.num_layers}) "
                          f"(model.profile={config.model.profile} has {profile.num_layers})") from None
    if config.paradigm_spec.trains:
        return
    if config.train.rounds != 1:
        raise ConfigError("train.rounds", config.train.rounds, "1 under paradigm mtv (a task vector is released once; "
                          "every further release would spend its budget again)")
    if config.pruning.policy != "off":
        raise ConfigError("pruning.policy", config.pruning.policy, "off under paradigm mtv (no visual tokens cross a cut)")
    if options.chunks < config.clients.count:
        raise ConfigError("privacy.mtv.chunks", options.chunks, f">= clients.count={config.clients.count} (every "
                          "client builds at least one chunk)")
    train_limit = config.data.train_limit
    if train_limit and config.data.partition == "iid":
        most = max(chunk_counts(options.chunks, config.clients.count))
        rows = train_limit // config.clients.count
        if most * (options.shots + 1) > rows:
            raise ConfigError("privacy.mtv.chunks", options.chunks, f"at most {rows // (options.shots + 1) * config.clients.count}"
                              f": the clients' {rows} training rows each hold {rows // (options.shots + 1)} chunks of "
                              f"{options.shots} demonstrations and a target (data.train_limit={train_limit})")
    if train_limit and options.private and options.delta >= 1 / train_limit:
        raise ConfigError("privacy.mtv.delta", options.delta, f"< 1/data.train_limit = {1 / train_limit:.3g} (the "
                          "private rows: a delta that large lets a mechanism publish one example outright)")
    if options.noise == DISTRIBUTED and not config.privacy.secagg.enabled:
        raise ConfigError("privacy.mtv.noise", options.noise, "central, or distributed with privacy.secagg.enabled "
                          "(without secure aggregation the server sees each client's sum with a 1/√n share of the noise)")
    if options.noise == DISTRIBUTED and options.private:
        # SecAgg+ clips every value a client sends to ±clipping_range: its noise share must pass whole,
        # or the sum carries less noise than the release is charged for.
        share_std = sum_noise_std(options, len(layout.layers)) / math.sqrt(config.clients.count) / min(
            chunk_counts(options.chunks, config.clients.count))
        needed = options.clip + 6 * share_std
        if config.privacy.secagg.clipping_range < needed:
            raise ConfigError("privacy.secagg.clipping_range", config.privacy.secagg.clipping_range,
                              f">= {needed:.3g} under privacy.mtv.noise=distributed: a client's mean carries values up "
                              f"to C={options.clip:g} and its noise share has std {share_std:.3g}, and SecAgg+ clips "
                              "each value to the range (6 std: the share passes whole but for a 2e-9 chance per value)")
    if options.selection == PRIVATE and (options.noise == DISTRIBUTED or config.privacy.secagg.enabled):
        raise ConfigError("privacy.mtv.selection", options.selection, "public under privacy.secagg.enabled or "
                          "noise=distributed (private selection sends each client's candidate scores to the server)")


def _check_dp_sgd(config: SimConfig) -> None:
    """What DP-SGD's per-sample gradients rule out, and the budget it can promise, before any
    model or data loads (each client calibrates to its own sample count when it starts)."""
    if config.train.grad_accum != 1:
        raise OptionError("mode", SGD, f"not sgd with train.grad_accum={config.train.grad_accum} (each step's batch "
                          "is one sample draw)")
    batch_level = [name for name in parse_defense_names(config.privacy.defenses) if defense_class(name).stage == LOSS]
    if batch_level:
        raise OptionError("mode", SGD, f"not sgd with {', '.join(batch_level)} in privacy.defenses (a loss term over "
                          "the whole batch has no per-sample gradient to clip)")
    if config.data.train_limit:
        # The largest share a client can hold bounds delta from above: checked again on each client.
        if config.privacy.dp.delta >= 1 / config.data.train_limit:
            raise OptionError("delta", config.privacy.dp.delta, f"< 1/data.train_limit = {1 / config.data.train_limit:.3g} "
                              "(delta must be below one over a client's training samples, whatever the partition)")


def _validate_pruning(pruning: PruningConfig, profile_name: str, client_layers: int) -> None:
    _choice("pruning.policy", pruning.policy, policy_names())
    spec = get_policy(pruning.policy)
    settings = asdict(pruning)
    options = policy_options(spec, settings)
    try:
        options.validate()
        # A policy that runs the client's decoder layers says which it needs.
        if hasattr(options, "validate_for_client"):
            options.validate_for_client(client_layers)
    except OptionError as error:
        raise ConfigError(f"pruning.{error.option}", error.value, error.allowed) from None
    # Another policy's option keeps its default: a ratio set for a policy that ignores it is a mistake.
    declared = {policy.name: asdict(policy.Options()) for policy in POLICIES}
    defaults = asdict(PruningConfig())
    for key in sorted({key for options in declared.values() for key in options} - set(declared[spec.name])):
        if settings[key] != defaults[key]:
            owners = ", ".join(name for name, options in declared.items() if key in options)
            default = f"{defaults[key]:g}" if isinstance(defaults[key], float) else repr(defaults[key])
            raise ConfigError(f"pruning.{key}", settings[key], f"{default} unless pruning.policy is one of: {owners}")
    _at_least("pruning.alpha", pruning.alpha, 0)
    _at_least("pruning.beta", pruning.beta, 0)
    if pruning.alpha == pruning.beta == 0:
        raise ConfigError("pruning.beta", pruning.beta, "> 0 when pruning.alpha=0 (the fused score would be 0 everywhere)")
    if spec.required_artifact and not pruning.artifacts:
        raise ConfigError(
            "pruning.artifacts", pruning.artifacts, f"the folder holding {spec.required_artifact} (policy {pruning.policy})"
        )
    # Checked here, not when a client builds its selector: a typo must fail before any model loads.
    needed = spec.required_artifact
    if needed and not (Path(pruning.artifacts).expanduser() / needed).is_file():
        raise ConfigError(
            "pruning.artifacts",
            pruning.artifacts,
            f"a folder holding {needed} (make one with `qpriv-prune prepare --out FOLDER`)",
        )
    # Only a profile with real encoders (hub ids) reads a source.
    for key, hub_id in (("text_source", "text_hf_id"), ("dino_source", "dino_hf_id")):
        source = getattr(pruning, key)
        if source and getattr(get_pruning_profile(profile_name), hub_id) is None:
            raise ConfigError(
                f"pruning.{key}", source, f"'' (model.profile={profile_name!r} builds its own seeded encoders)"
            )
