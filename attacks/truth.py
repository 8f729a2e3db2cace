"""The victims' side of a recording, for scoring attacks (the attacker never reads it).

`StaticTruth` is a truth given outright (tests, hand-made recordings). `RunTruth`
rebuilds it for a recorded run from the run's config and the data the clients read
(training.data.RunData: the same datasets, partitions, tokenizer and marks), and the
batch of each training step from the seeded order (training.batches.train_positions).
A split client's step is located by the transfer's round and occurrence; an FL
update covers its round's T_l steps. Under pruning, the patches each sample sent are
the run's own selector applied again to that step's samples (every policy is a
deterministic function of the image and the question), and under EDGE defenses the
client's vision edge run again with that step's defense seed (training.batches.sent_visual_rows).
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from attacks.recording import RecordedTransfer
from pruning import VisualTokenSelector
from config import SimConfig, load_config
from training import protocol
from privacy import EDGE
from privacy.dp_mtv import client_chunks
from training.batches import VisionEdge, sent_visual_rows, train_positions
from training.data import RunData
from training.defenses import build_defenses
from training.model import load_party_model
from training.selector import build_selector
from training.store import PrivateStore
from vlm.features import VisionFeatureCache
from vlm.profiles import get_profile
from vqa import MarkRecord, VQASample


@dataclass
class StaticTruth:
    """Samples (and keep sets) per recorded transfer, by sequence number."""

    samples_by_seq: Mapping[int, list[VQASample]] = field(default_factory=dict)
    keep_by_seq: Mapping[int, list[torch.Tensor]] = field(default_factory=dict)
    members: list[VQASample] = field(default_factory=list)
    non_members: list[VQASample] = field(default_factory=list)
    marks_by_image: Mapping[str, MarkRecord] = field(default_factory=dict)
    # (included, excluded) canaries, each included by a fair coin; None: no audit.
    audit_canaries: tuple[list[VQASample], list[VQASample]] | None = None

    def samples(self, entry: RecordedTransfer) -> list[VQASample] | None:
        return self.samples_by_seq.get(entry.seq)

    def keep_sets(self, entry: RecordedTransfer) -> list[torch.Tensor] | None:
        return self.keep_by_seq.get(entry.seq)

    def membership(self) -> tuple[list[VQASample], list[VQASample]]:
        return list(self.members), list(self.non_members)

    def canaries(self) -> tuple[list[VQASample], list[VQASample]] | None:
        return self.audit_canaries

    def mark(self, sample: VQASample) -> MarkRecord | None:
        return self.marks_by_image.get(sample.image_id)


def run_node_partitions(run_folder: Path) -> dict[int, int]:
    """Node id -> partition id, as the server learned it at each start of the run (nodes.json)."""
    path = run_folder / protocol.NODE_PARTITIONS_FILE
    return {int(node): partition for node, partition in json.loads(path.read_text()).items()} if path.exists() else {}


def recorded_node_partitions(run_folder: Path) -> dict[int, int]:
    """Node id -> partition id, from the node ids each client store in the run folder noted
    (run folders written before the server kept nodes.json)."""
    mapping = {}
    for store in sorted((run_folder / "clients").glob("partition-*")):
        partition = int(store.name.removeprefix("partition-"))
        mapping.update({node: partition for node in PrivateStore(store).nodes()})
    return mapping


class RunTruth:
    """The truth of a run folder's recording.

    Node ids are not partition ids under `flwr run`: `node_partitions` (node id ->
    partition id) says which node held which partition. `from_run_folder` reads it from
    the run folder's nodes.json (else from the node ids the clients' stores noted); without either, the
    in-process grid's numbering (node i holds partition i − 1) is assumed, and refused
    when the recorded node ids do not fit it.
    Keep sets: every patch in order for unpruned runs; otherwise the run's selector
    (built as the clients built it) applied to the transfer's samples.
    """

    # The training transfers whose batch a step's seeded order gives.
    STEP_KINDS = (*(kind.name for kind in protocol.FIRST_CUT_ACTIVATION.values()), protocol.GRADIENT_AT_CB.name)

    def __init__(self, config: SimConfig, node_partitions: Mapping[int, int] | None = None,
                 faults: Mapping[tuple[int, int], str] | None = None) -> None:
        self.config = config
        self.data = RunData.build(config)
        self.shards = [list(self.data.train_shard(p)) for p in range(config.clients.count)]
        self.node_partitions = dict(node_partitions) if node_partitions is not None else None
        self.faults = dict(faults or {})

    @classmethod
    def from_run_folder(cls, path: str | Path, node_partitions: Mapping[int, int] | None = None) -> "RunTruth":
        path = Path(path)
        flat = json.loads((path / "config.json").read_text())["config"]
        faults = {}
        metrics = path / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                for fault in record.get("faults", []):
                    faults[record["round"], int(fault["client"])] = fault["reason"][-200:]
        if node_partitions is None:
            node_partitions = run_node_partitions(path) or recorded_node_partitions(path) or None
        return cls(load_config(flat), node_partitions, faults)

    def partition(self, node: int) -> int:
        if self.node_partitions is not None:
            if node not in self.node_partitions:
                raise KeyError(f"node {node} is not in node_partitions {sorted(self.node_partitions)}")
            return self.node_partitions[node]
        count = self.config.clients.count
        if not 1 <= node <= count:
            raise KeyError(
                f"node id {node} is not an in-process node (1..{count}); pass node_partitions (node id -> "
                "partition id) for runs under flwr run"
            )
        return node - 1

    def _step_samples(self, partition: int, step: int) -> list[VQASample]:
        shard = self.shards[partition]
        return [shard[p] for p in train_positions(self.config, len(shard), step)]

    def _step(self, entry: RecordedTransfer) -> int | None:
        """The training step of a split client's transfer (its batch's index in the seeded order)."""
        if entry.kind in self.STEP_KINDS and entry.direction == "up":
            return (entry.round - 1) * self.config.train.steps_per_round + entry.occurrence
        return None

    def samples(self, entry: RecordedTransfer) -> list[VQASample] | None:
        # A client fault breaks the step count of that round: its transfers are not scored.
        if (entry.round, entry.client) in self.faults:
            return None
        steps = self.config.train.steps_per_round
        partition = self.partition(entry.client)
        step = self._step(entry)
        if step is not None:
            return self._step_samples(partition, step)
        if entry.kind == protocol.ADAPTER_UPDATE.name:
            first = (entry.round - 1) * steps
            return [s for step in range(first, first + steps) for s in self._step_samples(partition, step)]
        return None

    def keep_sets(self, entry: RecordedTransfer) -> list[torch.Tensor] | None:
        """Per sample, the patch each sent visual row stands for, in the sent order."""
        samples = self.samples(entry)
        if samples is None:
            return None
        defenses = build_defenses(self.config)
        if self.config.pruning.policy == "off" and not defenses.acts_at(EDGE):
            patches = get_profile(self.config.model.profile).num_patches
            return [torch.arange(patches) for _ in samples]
        model, features, selector = self._victim_selection
        features.add(samples, progress=False)
        step = self._step(entry)
        edge = None
        if step is not None:
            edge = VisionEdge(defenses, defenses.seed_for(self.partition(entry.client), entry.round, step))
        sent = sent_visual_rows(model, features, selector, samples, next(model.parameters()).device, edge=edge)
        return [where.cpu() for where in sent.positions]

    @cached_property
    def _victim_selection(self) -> tuple[torch.nn.Module, VisionFeatureCache, VisualTokenSelector]:
        """The clients' model (for its vision edge), vision features and token selector, rebuilt
        from the run's config."""
        party = load_party_model(self.config)
        tokenizer = self.data.tokenizer(party.bundle)
        features = VisionFeatureCache(party.model, party.bundle.preprocess_images)
        return party.model, features, build_selector(self.config, tokenizer=tokenizer, device=party.device,
                                                      model=party.model, instruction=party.instruction,
                                                      pixel_values=features.sample_pixel_values)

    def membership(self) -> tuple[list[VQASample], list[VQASample]]:
        """With data.canaries: the canaries the clients trained on (under paradigm mtv: those a
        client placed as a demonstration in one of its task-vector chunks) and those they never
        saw, each with its random answer (memorising it is the only way to score it well). Without:
        every client's training shard, and the test questions clients score on (never trained
        on) — whose images the training split does not share."""
        if self.data.canary_members and not self.config.paradigm_spec.trains:
            canaries = {(s.image_id, s.question, s.answer) for s in self.data.canary_members}
            options, count = self.config.privacy.mtv, self.config.clients.count
            shown = [shard[index] for partition, shard in enumerate(self.shards)
                     for chunk in client_chunks(options, count, partition, len(shard), self.config.privacy.seed)
                     for index in chunk[:-1] if (shard[index].image_id, shard[index].question, shard[index].answer) in canaries]
            return shown, list(self.data.canary_non_members)
        if self.data.canary_members:
            return list(self.data.canary_members), list(self.data.canary_non_members)
        members = [s for shard in self.shards for s in shard]
        return members, list(self.data.test_all)

    def canaries(self) -> tuple[list[VQASample], list[VQASample]] | None:
        """With data.canaries: every canary a client's coin put in its training data, and every one
        it left out (under paradigm mtv too: a canary held is in the mechanism's input, shown as a
        demonstration or not)."""
        if not self.data.canary_members and not self.data.canary_non_members:
            return None
        return list(self.data.canary_members), list(self.data.canary_non_members)

    def mark(self, sample: VQASample) -> MarkRecord | None:
        return self.data.marks.get(sample.image_id)
