"""Federated DP-MTV's server (paradigm mtv): one round that releases a task vector, then scores it.

1. Shares. Every client sends the sum of its clipped chunk activations and its chunk count
   (clients.mtv.share): one message each through the wire, or, under privacy.secagg, Flower's
   SecAgg+ protocol, which hands the server only the chunk-weighted average of the clients' means.
   A client's count is the share of privacy.mtv.chunks its partition builds (public); a reply
   that claims another count is refused, so no client can lower the noise by inflating m.
2. Release (privacy.dp_mtv.release_sum): the summed sums over m plus Gaussian noise, drawn here
   once (noise = central) or already in the clients' shares (noise = distributed). A client that
   dropped out of a distributed release took its noise share with it: the release is charged at
   the ε the noise that arrived gives.
3. Head selection. Public: REINFORCE on public queries (rows of threat.aux_split no client
   holds) with the released values, on the server: post-processing, free. Private: each client's
   counts over the candidate masks of the released values, summed, and the exponential mechanism
   over them, costing ε_sel (the server sees each client's counts: a trusted aggregator, so not
   under SecAgg+).
4. Evaluation. The task vector and mask go to every client, which answers its test share with
   it and zero-shot (the gain the vector brings, from the same questions).

The release (values, mask, ledger, report without private diagnostics) is saved as
<run>/task_vector.pt; the round's metrics hold its ε and δ as dp_epsilon and dp_delta.
"""

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from config import SimConfig
from privacy.dp_mtv import (
    DISTRIBUTED,
    PUBLIC,
    PrivacyLedger,
    TaskVector,
    candidate_masks,
    chunk_counts,
    exponential_mechanism,
    release_sum,
)
from strategies.base import FAULTS, ClientFault, Outcomes, RoundStrategy
from strategies.callbacks import RunCallback
from strategies.secagg import SECAGG_ROUND_TRIPS, SecureAggregation
from training import protocol
from vlm.profiles import get_profile
from vlm.task_vectors import profile_head_layout, reinforce_head_mask
from wire import Transfer, Wire

class MTVStrategy(RoundStrategy):
    def __init__(
        self, config: SimConfig, wire: Wire, callbacks: Sequence[RunCallback], partitions: Mapping[int, int]
    ) -> None:
        super().__init__(config, wire, callbacks)
        self.options = config.privacy.mtv
        # Node id -> partition id; each partition's chunk count is public.
        self.partitions = dict(partitions)
        self.chunks = chunk_counts(self.options.chunks, config.clients.count)
        self.layout = profile_head_layout(get_profile(config.model.profile), self.options.layer_indices)
        self.secagg = SecureAggregation(config) if config.privacy.secagg.enabled else None
        self.vector: TaskVector | None = None

    def _generator(self, purpose: str) -> torch.Generator:
        digest = hashlib.sha256(f"mtv:{purpose}:{self.config.privacy.seed}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)

    def _sizes(self) -> dict[str, int]:
        layers, heads, head_dim = self.layout.shape
        return {protocol.LAYERS: layers, protocol.HEADS: heads, protocol.HEAD_DIM: head_dim}

    # -- one message to every client at once ----------------------------------------------------
    def _broadcast(
        self, grid: Grid, round_: int, nodes: Sequence[int], message_type: str, tensors: dict | None, phase: str,
    ) -> dict[int, RecordDict]:
        """`message_type` to every node in one round trip; the replies that came back without an
        error (the rest are recorded as faults), by node."""
        content = RecordDict({protocol.CONFIG: ConfigRecord({"round": round_})})
        if tensors is not None:
            content[protocol.TENSORS] = self.wire.encode(tensors)
        messages = []
        for node in nodes:
            self.wire.sent(round_, node, content)
            messages.append(Message(content=content, message_type=message_type, dst_node_id=node))
        replies = {reply.metadata.src_node_id: reply
                   for reply in grid.send_and_receive(messages, timeout=self.config.faults.timeout_s)}
        self.round_trips[round_, phase] += 1
        answered = {}
        for node in nodes:
            reply = replies.get(node)
            if reply is None:
                error = ClientFault(f"no reply to {message_type} within faults.timeout_s={self.config.faults.timeout_s}s")
            elif reply.has_error():
                error = ClientFault(f"{message_type} raised on the client: {reply.error.reason.strip()}")
            else:
                answered[node] = reply.content
                continue
            self.record_fault(round_, node, phase, error, self._consequence(phase))
        return answered

    @staticmethod
    def _consequence(phase: str) -> str:
        return "left out of the task vector" if phase == "train" else "not scored this round"

    # -- 1. shares ------------------------------------------------------------------------------
    def _shares(self, grid: Grid, round_: int, nodes: Sequence[int]) -> tuple[torch.Tensor, int, int]:
        """(the summed shares, their chunk count, the clients that contributed)."""
        total, chunks, contributors = torch.zeros(self.layout.shape), 0, 0
        for node, content in self._broadcast(grid, round_, nodes, protocol.TRAIN, None, "train").items():
            try:
                share = self.receive(round_, node, protocol.TASK_VECTOR_SHARE, content, **self._sizes())[protocol.SHARE]
                count = self._checked_count(node, content.metric_records[protocol.METRICS]["num-examples"])
            except (*FAULTS, KeyError) as error:
                self.record_fault(round_, node, "train", error, self._consequence("train"))
                continue
            total, chunks, contributors = total + share.float(), chunks + count, contributors + 1
        return total, chunks, contributors

    def _checked_count(self, node: int, reported: float) -> int:
        expected = self.chunks[self.partitions[node]]
        if reported != expected:
            raise ClientFault(f"reported {reported:g} chunks; its partition builds {expected} of privacy.mtv.chunks")
        return expected

    def _secure_shares(self, grid: Grid, round_: int, nodes: Sequence[int]) -> tuple[torch.Tensor, int, int]:
        """The same through SecAgg+: the server unmasks only the weighted average of the clients' means."""
        content = RecordDict({protocol.CONFIG: ConfigRecord({"round": round_})})
        messages = [Message(content=content, message_type=protocol.TRAIN, dst_node_id=node) for node in nodes]
        result = self.secagg.round(grid, messages, round_)
        self.round_trips[round_, "train"] += SECAGG_ROUND_TRIPS
        for node in nodes:
            down, up = result.traffic.get(node, (0, 0))
            self.wire.ledger.add(round_, node, "down", down)
            self.wire.ledger.add(round_, node, "up", up)
        for node in nodes:
            if node not in result.metrics:
                why = f" ({'; '.join(result.failures)})" if result.failures else ""
                self.record_fault(round_, node, "train", ClientFault(f"dropped out of the SecAgg+ round{why}; its "
                                  "masks were removed from the sum"), self._consequence("train"))
        if result.average is None:
            raise RuntimeError(f"no task vector in round {round_}: {'; '.join(result.failures) or 'no share arrived'}")
        chunks = 0
        for node in sorted(result.metrics, key=lambda node: self.partitions[node]):
            try:
                chunks += self._checked_count(node, result.metrics[node]["num-examples"])
            except ClientFault as error:
                # Its share is in the secure sum, weighted by the count it claimed: no release from it.
                raise RuntimeError(f"no task vector in round {round_}: client {node} {error}") from None
            # What the server received of it: the masked vector.
            masked = torch.from_numpy(result.masked[node][0]).float().reshape(self.layout.shape)
            self.wire.show(Transfer(round_, node, protocol.TASK_VECTOR_SHARE.name, {protocol.SHARE: masked},
                                    result.traffic[node][1]))
        (average,) = result.average
        return torch.from_numpy(average).float().reshape(self.layout.shape) * chunks, chunks, len(result.metrics)

    # -- the round --------------------------------------------------------------------------------
    def train_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        shares = self._secure_shares if self.secagg else self._shares
        total, chunks, contributors = shares(grid, round_, nodes)
        if not contributors:
            raise RuntimeError(f"no client's share arrived in round {round_}: {self.faults.get(round_, [])}")
        ledger = PrivacyLedger()
        noise_carried = contributors / len(nodes) if self.options.noise == DISTRIBUTED else None
        values, std = release_sum(total, chunks, self.options, self._generator("release"), ledger,
                                  clients_noise_share=noise_carried)
        report: dict[str, Any] = {"options": asdict(self.options), "layers": list(self.layout.layers),
                                  "heads_per_layer": self.layout.heads, "head_dim": self.layout.head_dim,
                                  "chunks": chunks, "clients": contributors, "noise_std": std}
        if self.options.selection == PUBLIC:
            mask, report["selection"] = self._public_selection(values)
        else:
            mask, report["selection"] = self._private_selection(grid, round_, nodes, values, ledger)
        report["selected_heads"] = int(mask.sum())
        report["ledger"] = ledger.to_dict()
        self.vector = TaskVector(self.layout, values, mask, ledger, report)
        self.vector.save(self.config.run_folder() / protocol.TASK_VECTOR_FILE)
        record = {"chunks": chunks, "clients_averaged": contributors, "mtv_noise_std": std,
                  "selected_heads": int(mask.sum()), "selection": self.options.selection}
        if self.options.private:
            record.update({"dp_epsilon": ledger.epsilon, "dp_delta": ledger.delta,
                           "dp_epsilon_task_vector": ledger.entries[0]["epsilon"]})
        return record

    def _public_selection(self, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """REINFORCE on public queries, with the server's own copy of the public model."""
        from training.data import RunData
        from training.model import load_bundle, prompt_instruction, resolve_device
        from vlm.features import VisionFeatureCache

        bundle = load_bundle(self.config, resolve_device(self.config.model.device))
        data = RunData.build(self.config)
        public = data.auxiliary(self.options.public_queries)
        features = VisionFeatureCache(bundle.model, bundle.preprocess_images)
        features.add(public, progress=False)
        mask, rewards = reinforce_head_mask(bundle.model.eval(), data.tokenizer(bundle), features, public, self.layout,
                                            values, self.options.reinforce, instruction=prompt_instruction(bundle.profile),
                                            generator=self._generator("reinforce"), progress=False)
        return mask, {"method": PUBLIC, "reinforce": asdict(self.options.reinforce), "public_queries": len(public),
                      "rewards": rewards}

    def _private_selection(
        self, grid: Grid, round_: int, nodes: Sequence[int], values: torch.Tensor, ledger: PrivacyLedger
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The exponential mechanism over the clients' summed counts (sensitivity 1: one example
        is in one chunk of one client, which adds 0 or 1 to each count)."""
        masks = candidate_masks(values)
        scores = torch.zeros(len(masks), dtype=torch.int64)
        replies = self._broadcast(grid, round_, nodes, protocol.MTV_SCORES, {protocol.VALUES: values}, "train")
        for node, content in replies.items():
            try:
                counts = self.receive(round_, node, protocol.SELECTION_SCORES, content)[protocol.SCORES]
                if counts.shape != (len(masks),) or counts.min() < 0 or counts.max() > self.chunks[self.partitions[node]]:
                    raise ClientFault(f"scores of shape {tuple(counts.shape)} in [{int(counts.min())}, "
                                      f"{int(counts.max())}]; expected {len(masks)} counts of its chunks")
            except FAULTS as error:
                self.record_fault(round_, node, "train", error, "its chunks left out of head selection")
                continue
            scores += counts.long()
        chosen = exponential_mechanism(scores.tolist(), self.options.selection_epsilon, 1.0,
                                       self._generator("selection"))
        ledger.charge("head selection (exponential mechanism)", self.options.selection_epsilon, 0.0,
                      candidates=len(masks))
        return masks[chosen], {"method": "private", "candidates": len(masks), "chosen": chosen}

    def evaluate_round(self, grid: Grid, round_: int, nodes: list[int]) -> dict[str, Any]:
        tensors = {protocol.VALUES: self.vector.values, protocol.MASK: self.vector.mask.int()}
        correct = zero_shot = count = 0.0
        outcomes = Outcomes(zero_shot=True)
        for node, content in self._broadcast(grid, round_, nodes, protocol.MTV_EVALUATE, tensors, "evaluate").items():
            self.receive(round_, node, protocol.EVALUATION_SCORE, content)
            metrics = content.metric_records[protocol.METRICS]
            outcomes.add(metrics)
            correct, zero_shot, count = correct + metrics["correct"], zero_shot + metrics["zero_shot_correct"], count + metrics["count"]
        if not count:
            return {"test_accuracy": None, "test_count": 0, **outcomes.record()}
        return {"test_accuracy": correct / count, "zero_shot_accuracy": zero_shot / count, "test_count": count,
                **outcomes.record()}

    def state_dict(self) -> dict[str, Any]:
        if self.vector is None:
            return {}
        return {"values": self.vector.values, "mask": self.vector.mask, "report": self.vector.report}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            ledger = PrivacyLedger(list(state["report"]["ledger"]["entries"]))
            self.vector = TaskVector(self.layout, state["values"], state["mask"], ledger, state["report"])
