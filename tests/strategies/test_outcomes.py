"""Each evaluated round's per-question outcomes in the run folder (outcomes.jsonl): every test
question by its id, with the score it got, whose mean is the round's test_accuracy; a resumed run
does not repeat a round's."""

import json
import math

import pytest

from clients import local, mtv, split
from clients.app import app as client_app
from config import load_config
from strategies.app import run
from strategies.callbacks import Checkpointer
from training.data import RunData
from training.protocol import OUTCOMES_FILE
from process_death import Killed


def outcomes(folder):
    return [json.loads(line) for line in (folder.path / OUTCOMES_FILE).read_text().splitlines()]


def metrics(folder):
    return [json.loads(line) for line in (folder.path / "metrics.jsonl").read_text().splitlines()]


def known_score(sample) -> float:
    """What a question scores whatever the model answers (a tiny random model scores 0 everywhere):
    0, 0.5 or 1, by its id."""
    return sum(map(ord, sample.id)) % 3 / 2


@pytest.fixture
def known_scores(monkeypatch):
    for module in (local, split):
        monkeypatch.setattr(module, "score_sample", lambda prediction, sample: known_score(sample))


@pytest.mark.parametrize("paradigm", ["usl", "sl", "fl", "cl"])
def test_an_evaluated_round_records_each_test_questions_score_by_its_id(paradigm, run_config, fake_grid, known_scores):
    count = 1 if paradigm == "cl" else 2
    # 7 questions: the clients' shares differ in size; batches of 2: a share spans several batches.
    raw = run_config(paradigm=paradigm, **{"clients.count": count, "data.test_limit": 7, "eval.every": 1,
                                           "eval.batch_size": 2})
    folder = run(fake_grid(client_app, raw, count), load_config(raw))
    (line,), (record,) = outcomes(folder), metrics(folder)
    test = RunData.build(load_config(raw)).test_all
    assert line["round"] == 1 and record["test_count"] == len(test) == 7
    assert line["questions"] == [sample.id for sample in test] and line["positions"] == list(range(7))
    assert line["scores"] == [known_score(sample) for sample in test]
    assert sum(line["scores"]) / 7 == pytest.approx(record["test_accuracy"])
    assert "outcomes" not in record


def test_mtv_records_each_questions_score_with_the_task_vector_and_zero_shot(run_config, fake_grid, monkeypatch):
    scored = set()

    def score(prediction, sample):
        # A client answers its share with the task vector first, then zero-shot.
        first = sample.id not in scored
        scored.add(sample.id)
        return known_score(sample) if first else 1 - known_score(sample)

    monkeypatch.setattr(mtv, "score_sample", score)
    raw = run_config(**{"paradigm": "mtv", "data.train_limit": 40, "privacy.mtv.chunks": 6, "privacy.mtv.shots": 2,
                        "privacy.mtv.epsilon": math.inf, "privacy.mtv.delta": 1e-3, "privacy.mtv.public_queries": 8,
                        "privacy.mtv.reinforce_steps": 1, "eval.every": 1})
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    (line,), (record,) = outcomes(folder), metrics(folder)
    test = RunData.build(load_config(raw)).test_all
    assert line["questions"] == [sample.id for sample in test]
    assert line["scores"] == [known_score(sample) for sample in test]
    assert line["zero_shot"] == [1 - known_score(sample) for sample in test]
    assert sum(line["scores"]) / len(test) == pytest.approx(record["test_accuracy"])
    assert sum(line["zero_shot"]) / len(test) == pytest.approx(record["zero_shot_accuracy"])


def test_a_resumed_run_does_not_repeat_a_rounds_outcomes(run_config, fake_grid, known_scores, monkeypatch):
    raw = run_config(**{"train.rounds": 2, "eval.every": 1})
    commit = Checkpointer.on_round_end

    def die_before_committing_round_two(self, round_, metrics, state):
        if round_ == 2:
            raise Killed
        commit(self, round_, metrics, state)

    # Round 2's outcomes are written, its checkpoint never commits, and a torn line follows.
    monkeypatch.setattr(Checkpointer, "on_round_end", die_before_committing_round_two)
    with pytest.raises(Killed):
        run(fake_grid(client_app, raw, 2), load_config(raw))
    path = load_config(raw).run_folder() / OUTCOMES_FILE
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [1, 2]
    with path.open("a") as handle:
        handle.write('{"round": 3, "positions": [0, 1')
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text().splitlines()[-1])

    monkeypatch.setattr(Checkpointer, "on_round_end", commit)
    folder = run(fake_grid(client_app, raw, 2), load_config(raw))
    lines = outcomes(folder)
    assert [line["round"] for line in lines] == [1, 2]
    test = RunData.build(load_config(raw)).test_all
    assert all(line["questions"] == [sample.id for sample in test] for line in lines)
