"""The loopback federation of the deployment tests (test_deploy.py, test_deploy_restarts.py): one
per test file, so the two files run side by side."""

from pathlib import Path

import pytest

from sims.launch import toml_value
from sims.loopback import LoopbackFederation


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    with LoopbackFederation(tmp_path_factory.mktemp("deploy"), nodes=2) as fed:
        yield fed


@pytest.fixture
def small_run(tmp_path: Path):
    """small_run(name, **changes): --run-config of the smallest run of two clients (one round of
    one step) written under tmp_path/name, with `changes`."""
    def config(name: str, **changes) -> str:
        values = {"model.profile": "tiny", "data.train_limit": 16, "data.test_limit": 4, "clients.count": 2,
                  "train.rounds": 1, "train.steps_per_round": 1, "train.batch_size": 4, "eval.every": 0,
                  "faults.timeout_s": 30.0, "output.root": str(tmp_path), "output.name": name, **changes}
        return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())
    return config
