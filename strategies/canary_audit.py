"""The auditing server's canary clients (threat.update_canaries), wrapped around FedAvg.

`CanaryAudit` wraps the FL strategy inside Flower's DP wrapper (strategies.dp): the DP
wrapper clips each real update and hands them to this wrapper's `aggregate_train`, which lets
FedAvg average them and adds the included canaries as clients of the round (each C/n on its
coordinate, n the clients averaged; a canary's norm is the clipping norm, so clipping would leave
it as it is); the DP wrapper then noises the sum as it noises any round. Under poisson sampling
(clients.sampling) n is the expected cohort and each canary joins a round by its own coin of the
real clients' probability. So a canary is a client the mechanism protects like any other, which
is what the audit must measure.

Each round, the global adapters before training and after aggregation (noise included) score
the canaries (attacks.update_canaries.CanarySet); the scores so far are written to the run
folder's `update_canaries.json` after each aggregation, and a resumed run keeps only those of
its committed rounds. Everything else is the wrapped strategy's.
"""

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from attacks.update_canaries import UPDATE_CANARIES_FILE, CanarySet
from config import SimConfig
from strategies.callbacks import write_json_atomically
from wire import numpy_record, numpy_tensors


class CanaryAudit(Strategy):
    """Canary clients around `strategy`, the run's FedAvg (strategies.fl.WireFedAvg, whose round
    numbering, sampling and denominator they follow)."""

    def __init__(self, config: SimConfig, strategy: FedAvg, shapes: dict[str, tuple[int, ...]], folder: Path,
                 committed_round: int) -> None:
        self.strategy, self.folder = strategy, folder
        self.norm, self.seed = config.privacy.dp.clip, config.privacy.seed
        self.canaries = CanarySet(config.threat.update_canaries, shapes, seed=config.privacy.seed)
        path = folder / UPDATE_CANARIES_FILE
        if committed_round and path.is_file():
            self.canaries.load_scores(json.loads(path.read_text()), committed_round)
        self.before: ArrayRecord | None = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.before = arrays
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        joining = None
        if self.strategy.poisson:
            draw = np.random.default_rng([self.seed, self.strategy.round_of(server_round)])
            joining = draw.random(self.canaries.count) < self.strategy.fraction_train
        added = self.canaries.contribution(self.norm, self.strategy.denominator(len(replies)), joining)
        averaged = numpy_tensors(arrays)
        return numpy_record({name: value + torch.from_numpy(added[name]) for name, value in averaged.items()}), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        # `arrays` is the round's aggregate as the loop goes on with it, after any DP noise.
        if self.before is not None:
            before = {k: v.numpy() for k, v in numpy_tensors(self.before).items()}
            after = {k: v.numpy() for k, v in numpy_tensors(arrays).items()}
            self.canaries.score_round(self.strategy.round_of(server_round), before, after)
            write_json_atomically(self.folder / UPDATE_CANARIES_FILE, self.canaries.to_json())
            self.before = None
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()
