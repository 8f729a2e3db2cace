"""FedAvg's training round through Flower's SecAgg+ protocol (privacy.secagg).

Flower ships SecAgg+ for its legacy API only: `SecAggPlusWorkflow` runs four stages (setup,
share keys, collect masked vectors, unmask) against a `LegacyContext` whose strategy samples
the clients and receives the unmasked aggregate. `SecureRound` drives those stages for one
round of this system's FedAvg: the clients are the round's sampled nodes, what stage 2 sends
each of them is the message the FL strategy composed (its adapters, through the wire), and the
legacy strategy's `aggregate_fit` hands back the weighted average of the survivors' adapters,
which the server never saw one by one.

What the server does see of each client is its masked vector (`SecureRound.masked`): the
integers modulo 2**32 it received in stage 2, for the recorder to keep as that client's update.
Every stage's messages count in the round's bytes.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, NDArrays, Parameters, bytes_to_ndarray, parameters_to_ndarrays
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow, WorkflowState
from flwr.serverapp import Grid

from config import SimConfig
from config.schema import secagg_weight
from privacy.secagg import MODULUS_RANGE
from strategies.base import GridWrapper
from training import protocol
from wire import serialized_size

# Setup, share keys, collect masked vectors, unmask: each a round trip to every client.
SECAGG_ROUND_TRIPS = 4


@dataclass
class _Node:
    """What the legacy workflow needs of a client proxy: its node id."""

    node_id: int


@dataclass
class SecureRound:
    """What one SecAgg+ round left the server: the survivors' weighted average, their reported
    example counts and losses (in the clear), and what it received from each of them."""

    average: NDArrays | None = None
    # node -> the metrics its reply reported in the clear (example count, loss, pruning).
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    # node -> its stage-2 vector as received: masked integers (mod 2**32), dequantised the way the
    # server reads the unmasked sum — the nearest thing to that client's update the server holds.
    masked: dict[int, NDArrays] = field(default_factory=dict)
    # node -> (bytes down, bytes up) over the protocol's four stages.
    traffic: dict[int, list[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class _LegacyRound:
    """The legacy strategy the workflow consults: it samples the round's nodes and keeps the
    unmasked aggregate (each result's parameters are that aggregate)."""

    def __init__(self, nodes: Iterable[int], result: SecureRound) -> None:
        self.nodes, self.result = list(nodes), result

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return [(_Node(node), FitIns(parameters, {})) for node in self.nodes]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Parameters | None, dict]:
        if not results:
            return None, {}
        self.result.average = parameters_to_ndarrays(results[0][1].parameters)
        for proxy, fitres in results:
            self.result.metrics[proxy.node_id] = json.loads(fitres.metrics[protocol.SECAGG_METRICS])
        self.result.failures += [str(failure) for failure in failures]
        return results[0][1].parameters, {}


class _TappedGrid(GridWrapper):
    """The run's grid as the workflow sees it: every message of every stage counted per node,
    and each client's masked vector kept as it arrives."""

    def __init__(self, grid: Grid, result: SecureRound, clipping_range: float, quantization_range: int) -> None:
        super().__init__(grid)
        self.result = result
        self.clipping_range, self.quantization_range = clipping_range, quantization_range

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        for message in messages:
            self.result.traffic.setdefault(message.metadata.dst_node_id, [0, 0])[0] += serialized_size(message.content)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if reply.has_error():
                continue
            node = reply.metadata.src_node_id
            self.result.traffic.setdefault(node, [0, 0])[1] += serialized_size(reply.content)
            configs = reply.content.config_records.get(RECORD_KEY_CONFIGS, ConfigRecord())
            if Key.MASKED_PARAMETERS in configs:
                masked = [bytes_to_ndarray(data) for data in configs[Key.MASKED_PARAMETERS]]
                # The first entry is the quantised weight factor_combine put in front of the vectors.
                self.result.masked[node] = dequantize(masked[1:], self.clipping_range, self.quantization_range)
        return replies


class SecureAggregation:
    """Flower's SecAgg+ workflow with the run's options, one `round` per FL training round."""

    def __init__(self, config: SimConfig) -> None:
        options = config.privacy.secagg
        shares, threshold, max_weight = options.resolved(config.clients.sampled, secagg_weight(config))
        self.options = options
        self.workflow = SecAggPlusWorkflow(
            shares, threshold, max_weight=max_weight, clipping_range=options.clipping_range,
            quantization_range=options.quantization_range, modulus_range=MODULUS_RANGE, timeout=config.faults.timeout_s,
        )

    def round(self, grid: Grid, messages: list[Message], round_: int) -> SecureRound:
        """Run the protocol with the round's composed messages (one per sampled node) as stage 2's content."""
        result = SecureRound()
        legacy = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                               strategy=_LegacyRound([m.metadata.dst_node_id for m in messages], result))
        legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round_})
        legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        tapped = _TappedGrid(grid, result, self.options.clipping_range, self.options.quantization_range)
        state = WorkflowState()
        if not self.workflow.setup_stage(tapped, legacy, state):
            return self._halted(result, "setup", state)
        # Stage 2 sends each node the FL strategy's own message (the adapters through the wire).
        state.nid_to_fitins = {m.metadata.dst_node_id: RecordDict(dict(m.content.items())) for m in messages}
        for stage, name in ((self.workflow.share_keys_stage, "share keys"),
                            (self.workflow.collect_masked_vectors_stage, "collect masked vectors"),
                            (self.workflow.unmask_stage, "unmask")):
            if not stage(tapped, legacy, state):
                return self._halted(result, name, state)
        return result

    def _halted(self, result: SecureRound, stage: str, state: WorkflowState) -> SecureRound:
        reasons = "; ".join(str(failure) for failure in state.failures) or "too few clients left"
        result.failures.append(f"SecAgg+ halted at its {stage} stage ({reasons}; threshold {state.threshold})")
        result.average = None
        return result

