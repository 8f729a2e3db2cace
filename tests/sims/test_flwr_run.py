"""End-to-end: the sims through the real `flwr run` (simulation runtime, Ray).

Slow (a SuperLink and Ray start each time), so only two: a run that must finish and
one that must fail fast — both judged by the run folder's status, since
`flwr run --stream` exits 0 either way. Each test session gets its own FLWR_HOME and
ports, and stops the SuperLink it started.
"""

import json
import os
from pathlib import Path

import pytest

from sims.launch import launch, stop_local_superlink

pytestmark = pytest.mark.flwr_run
SIMS = Path(__file__).parents[2] / "sims"


@pytest.fixture(scope="module")
def flwr_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    saved = {k: os.environ.get(k) for k in ("FLWR_HOME", "FLWR_LOCAL_CONTROL_API_PORT", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT")}
    os.environ.update(FLWR_HOME=str(home), FLWR_LOCAL_CONTROL_API_PORT="39293", FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="39294")
    yield home
    stop_local_superlink(home)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_usl_sim_finishes_with_two_round_trips_per_step(flwr_home, tmp_path):
    overrides = {
        "model.profile": "tiny", "data.train_limit": 24, "data.test_limit": 6, "train.rounds": 2,
        "train.steps_per_round": 4, "train.batch_size": 4, "eval.batch_size": 4, "eval.every": 2,
        "output.root": str(tmp_path), "output.name": "usl-smoke",
    }
    status, folder, process = launch(
        SIMS / "usl_easyvqa", overrides, "num-supernodes=2 client-resources-num-cpus=1", timeout_s=240
    )
    assert status["state"] == "finished", status.get("error", process.stdout[-2000:])
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert records[0]["round_trips_per_step"] == pytest.approx((2 * 4 + 1) / 4)
    assert records[1]["test_count"] == 6


def test_the_paper_sim_fails_fast_and_says_what_is_missing(flwr_home, tmp_path):
    status, _, process = launch(
        SIMS / "usl_vqarad", {"output.root": str(tmp_path)}, "num-supernodes=2", timeout_s=120
    )
    assert process.returncode == 0  # flwr's exit code does not tell; the status does
    assert status["state"] == "failed"
    assert status["error_type"] == "ModelNotAvailableError"
    assert "llava-1.5-7b" in status["error"] and "model.source" in status["error"]
