"""The ServerApp of every paradigm; `paradigm` in the run config picks the strategy.

Order matters: the config is validated before anything loads, the run folder's
status says "running" before the model loads, and any failure — bad config aside,
which has no folder yet — ends as status "failed" with its reason, because
`flwr run --stream` exits 0 either way. `threat.model` puts the adversarial server
around the strategy (strategies.adversarial).
"""

import logging
import time
from collections.abc import Callable, Sequence

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from config import SimConfig, load_config
from strategies.adversarial import FSHAHijack, subscribe_recorder
from strategies.base import RoundStrategy, federation_partitions
from strategies.callbacks import (Checkpointer, Heartbeat, MetricsLog, OutcomesLog, RunCallback, RunFolder,
                                  StatusReporter, failure_details, participation)
from strategies.cl import CLStrategy
from strategies.fl import WireFedAvg, WireGrid
from strategies.mtv import MTVStrategy
from strategies.split import SLStrategy, USLStrategy
from training.data import RunData
from training.model import SERVER, load_party_model
from vlm.lora import owner_state_dict
from wire import Transfer, Wire, numpy_record

log = logging.getLogger(__name__)

app = ServerApp()

# Observers of what the server receives register here (a threat model's recorder is added by the config).
OBSERVER_FACTORIES: list[Callable[[SimConfig, RunFolder], Callable[[Transfer], None]]] = []


def build_round_strategy(
    config: SimConfig, wire: Wire, callbacks: Sequence[RunCallback], folder: RunFolder, partitions: dict[int, int],
    *, resuming: bool = False,
) -> RoundStrategy:
    paradigm = config.paradigm_spec
    if not paradigm.wire:
        return CLStrategy(config, wire, callbacks)
    if not paradigm.trains:
        return MTVStrategy(config, wire, callbacks, partitions)
    # A hijacking server holds the whole public model (FSHA's pilot imitates the client's front).
    hijacking = config.threat_spec.hijacks
    party = load_party_model(config, None if hijacking else SERVER)
    strategy_class = {"sl": SLStrategy, "usl": USLStrategy}[config.paradigm]
    if hijacking:
        hijack = FSHAHijack(config, party, folder, pretrain=not resuming)
        return strategy_class(config, party, wire, [*callbacks, hijack], hijack)
    return strategy_class(config, party, wire, list(callbacks))


def run(grid: Grid, config: SimConfig) -> RunFolder:
    """Run (or resume) the simulation `config` describes on `grid`; returns its folder."""
    folder = RunFolder(config, config.run_folder())
    folder.write_status("starting")
    with Heartbeat(folder):
        return _run(grid, config, folder)


def _run(grid: Grid, config: SimConfig, folder: RunFolder) -> RunFolder:
    try:
        started = time.perf_counter()
        wire = Wire(config.wire.dtype)
        for factory in OBSERVER_FACTORIES:
            wire.subscribe(factory(config, folder))
        subscribe_recorder(config, wire, folder)
        first_round = folder.committed_round() + 1
        num_rounds = config.train.rounds
        # The logs first: they drop lines past the checkpoint, and the reporter reads metrics.jsonl's last one left.
        metrics_log = MetricsLog(folder)
        reporter = StatusReporter(folder, num_rounds)
        callbacks = [metrics_log, OutcomesLog(folder), Checkpointer(folder), reporter]
        checkpoint = folder.load_checkpoint()
        partitions = federation_partitions(grid, config)
        folder.record_nodes(partitions)
        if config.data.canaries:
            folder.record_canaries(RunData.build(config))
        if config.paradigm_spec.averages_updates:
            party = load_party_model(config)
            initial = owner_state_dict(party.model, party.segments[0])
            if checkpoint is not None:
                initial = checkpoint["arrays"]
            strategy = WireFedAvg(
                config, wire, {k: tuple(v.shape) for k, v in initial.items()}, partitions, callbacks, first_round,
                num_rounds,
            )
            if checkpoint is not None and strategy.dp:
                strategy.dp.load_state_dict(checkpoint["dp"])
            if first_round <= num_rounds:
                strategy.outer.start(
                    grid=WireGrid(grid, strategy),
                    initial_arrays=numpy_record(initial),
                    num_rounds=num_rounds - first_round + 1,
                    timeout=config.faults.timeout_s,
                    train_config=ConfigRecord(),
                    evaluate_config=ConfigRecord(),
                )
        else:
            strategy = build_round_strategy(config, wire, callbacks, folder, partitions, resuming=checkpoint is not None)
            if checkpoint is not None:
                strategy.load_state_dict(checkpoint)
            strategy.run(grid, list(partitions), first_round, num_rounds)
        folder.write_status(
            "finished", rounds=num_rounds, resumed_from=first_round - 1, wall_s=time.perf_counter() - started,
            **reporter.spent, **participation(folder, test_rows(config)),
        )
    except BaseException as error:
        folder.write_status("failed", **failure_details(error))
        raise
    return folder


def test_rows(config: SimConfig) -> int | None:
    """The rows of the run's test split its clients score together (None: this server cannot
    load the clients' data, as in a deployment that keeps it on the nodes)."""
    try:
        return len(RunData.build(config).test_all)
    except (OSError, ValueError):
        return None


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, load_config(context.run_config))
