"""The memorisation preset (sims/sweeps/memorisation.toml) and benchmarks/testbed_memorisation.py:
the preset's points validate as the shipped sweeps do, the curve's bookkeeping on the tiny
profile (random weights: its numbers mean nothing, its rows and counts do), and the merge into
results/testbed.json that keeps every other key."""

import json
import sys
import tomllib
from pathlib import Path

import pytest

from attacks.base import available_attacks
from sims.sweep import attack_done, load_sweep, run_state

REPOSITORY = Path(__file__).parents[2]
PRESET = REPOSITORY / "sims" / "sweeps" / "memorisation.toml"
sys.path.insert(0, str(REPOSITORY / "benchmarks"))

import testbed_memorisation as M  # noqa: E402

# The preset on the tiny profile: two points, a few steps each.
TINY = """
[sweep]
sim = "{sim}"
runner = "inprocess"
[fixed]
paradigm = "usl"
"model.profile" = "tiny"
"data.dataset" = "scenes-stamped"
"data.train_split" = "aux"
"data.test_split" = "test"
"data.test_limit" = 6
"clients.count" = 1
"train.batch_size" = 4
"eval.batch_size" = 8
"eval.every" = 2
"threat.model" = "passive"
"threat.aux_split" = "train"
"threat.aux_limit" = 8
"threat.max_samples" = 1
[[grid]]
name = "memorisation"
[[grid.zip]]
label = ["rows-4", "rows-8"]
"data.train_limit" = [4, 8]
"train.steps_per_round" = [1, 2]
"train.rounds" = [4, 2]
[attacks.mia_loss]
options = {{ candidates = 512, attribute_records = 0 }}
"""


def test_the_preset_validates_and_every_point_is_undefended_usl_on_the_scene_testbed(tmp_path):
    sweep = load_sweep(PRESET, out=tmp_path / "memorisation")
    assert len(sweep.points) >= 3
    assert sweep.runner == "inprocess"
    assert [plan.attack for plan in sweep.attacks] == ["mia_loss"] and "mia_loss" in available_attacks()
    rows = []
    for point in sweep.points:
        config = point.config
        assert (config.paradigm, config.model.profile, config.model.stage, config.data.dataset) == (
            "usl", "mini-scenes", "base", "scenes-stamped")
        assert config.privacy.defenses == "" and config.privacy.dp.mode == "off" and config.pruning.policy == "off"
        # One client: every member of the truth is a row of the attacked model's own data.
        assert config.clients.count == 1
        # One epoch per round, so train.rounds is the epochs.
        assert config.train.steps_per_round * config.train.batch_size == config.data.train_limit
        # The private rows come from a split the public base never trained on (it trained on `train`).
        assert config.data.train_split != "train" and config.data.test_split != "train"
        # The recording the replay opens exists; the attack applies to the point.
        assert config.threat.model == "passive"
        assert all(plan.applies_to(config.to_flat()) for plan in sweep.attacks)
        rows.append(config.data.train_limit)
    assert rows == sorted(rows) and len(set(rows)) == len(rows)


def test_the_preset_is_usable_as_run_config_overrides(tmp_path):
    """The [fixed] keys plus one point's keys, as a --run-config file, give that point's config."""
    from config import load_config
    from sims.launch import app_config, parse_overrides

    raw = tomllib.loads(PRESET.read_text())
    grid = raw["grid"][0]["zip"][0]
    point = {key: values[0] for key, values in grid.items() if key != "label"}
    lines = [f"{key} = {json.dumps(value)}" for key, value in {**raw["fixed"], **point}.items()]
    path = tmp_path / "overrides.toml"
    path.write_text("\n".join(lines + ['"output.name" = "memorisation"']) + "\n")
    config = load_config(app_config(REPOSITORY / raw["sweep"]["sim"], parse_overrides(str(path))))
    assert config.data.train_limit == point["data.train_limit"]
    assert config.train.rounds == point["train.rounds"]
    assert config.model.profile == "mini-scenes"


def test_checkpoints_and_epochs():
    assert M.checkpoint_rounds(40, (0.25, 0.5, 1.0)) == [10, 20, 40]
    assert M.checkpoint_rounds(3, (0.1, 0.5)) == [1, 2, 3]  # at least round 1, always the last
    assert M.checkpoint_rounds(5, ()) == [5]
    assert M.epochs_of(steps=32, batch_size=16, rows=128) == 4.0


def test_the_question_only_baseline_answers_each_text_with_its_most_frequent_training_answer():
    from vqa import VQASample

    def sample(i, question, answer, kind):
        return VQASample(id=f"s{i}", dataset="scenes", split="train", question=question, answer=answer,
                         answer_type="closed", question_kind=kind, image_id=f"i{i}", source_row=i,
                         image_ref=None)

    train = [sample(0, "Is there a red circle?", "no", "exist"), sample(1, "Is there a red circle?", "no", "exist"),
             sample(2, "Is there a red circle?", "yes", "exist"), sample(3, "How many circles are there?", "2", "count")]
    test = [sample(4, "Is there a red circle?", "no", "exist"), sample(5, "Is there a blue square?", "yes", "exist"),
            sample(6, "How many squares are there?", "2", "count")]
    baseline = M.question_only_accuracy(train, test)
    # Seen text: "no" (right); unseen exist text: the kind's "no" (wrong); unseen count text: "2" (right).
    assert baseline["accuracy"] == pytest.approx(2 / 3)
    assert baseline["by_kind"]["exist"] == {"accuracy": 0.5, "count": 2}


def test_the_results_merge_keeps_every_other_key(tmp_path):
    path = tmp_path / "results" / "testbed.json"
    M.merge_results(path, "memorisation", {"points": [1]})  # created when missing
    assert json.loads(path.read_text()) == {"memorisation": {"points": [1]}}
    path.write_text(json.dumps({"parts": {"accuracy": {"result": 0.5}}, "memorisation": {"points": []}, "model": "m"}))
    M.merge_results(path, "memorisation", {"points": [2]})
    assert json.loads(path.read_text()) == {"parts": {"accuracy": {"result": 0.5}}, "memorisation": {"points": [2]},
                                             "model": "m"}
    assert [p.name for p in path.parent.iterdir()] == ["testbed.json"]  # no temporary left behind
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        M.merge_results(path, "memorisation", {})


def test_the_curve_on_a_tiny_stand_in_records_each_point_at_each_epoch(tmp_path):
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY.format(sim=REPOSITORY / "sims" / "usl_easyvqa"))
    out = tmp_path / "sweep"
    result = M.measure_memorisation(preset, out=out, fractions=(0.5,), processes=1, progress=False)
    rows = result["points"]
    by_point = {}
    for row in rows:
        by_point.setdefault(row["point"], []).append(row)
    assert list(by_point) == ["memorisation-rows-4", "memorisation-rows-8"]
    # rows-4: 4 rounds of 1 step of 4 rows (1 epoch a round), measured at epoch 0, round 2 and round 4.
    four = by_point["memorisation-rows-4"]
    assert [(r["rounds"], r["steps"], r["epochs"]) for r in four] == [(0, 0, 0.0), (2, 2, 2.0), (4, 4, 4.0)]
    eight = by_point["memorisation-rows-8"]
    assert [(r["rounds"], r["steps"], r["epochs"]) for r in eight] == [(0, 0, 0.0), (1, 2, 1.0), (2, 4, 2.0)]
    for row in rows:
        assert row["train_rows"] in (4, 8)
        # As many members as non-members: the smaller of the training rows and the 6 test rows.
        assert row["members"] == row["non_members"] == min(row["train_rows"], 6)
        assert 0.0 <= row["mia_auc_low"] <= row["mia_auc"] <= row["mia_auc_high"] <= 1.0
        assert row["test_accuracy"] is not None and row["test_count"] == 6
    last = four[-1]
    assert set(last["test_accuracy_by_kind"]) <= {"location", "relation", "exist", "count", "unanswerable"}
    assert 0.0 <= last["train_accuracy"] <= 1.0
    assert 0.0 <= result["question_only_accuracy"] <= 1.0
    assert result["config"]["model.profile"] == "tiny" and result["config"]["clients.count"] == 1
    assert result["config"]["points"]["memorisation-rows-8"] == {"data.train_limit": 8, "train.steps_per_round": 2,
                                                                 "train.rounds": 2}
    json.dumps(result)  # what --write stores
    # The last epochs' result is where the sweep finds it: `qpriv-sweep run` on the folder replays nothing.
    sweep = load_sweep(preset, out=out)
    for point in sweep.points:
        assert run_state(point)["state"] == "finished"
        assert attack_done(point, "mia_loss")
    # Measured again: rounds the runs are past are skipped, the last one measured again.
    again = M.measure_memorisation(preset, out=out, fractions=(0.5,), processes=1, evaluate=False, progress=False,
                                   points=["*rows-8"])
    assert [(r["point"], r["rounds"]) for r in again["points"]] == [("memorisation-rows-8", 0), ("memorisation-rows-8", 2)]
    assert again["runs"][0]["skipped_rounds"] == [1]
