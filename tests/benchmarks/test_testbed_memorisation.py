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
        rows.append((config.data.question_kinds, config.data.train_limit))
    # Within a set of question kinds, the sizes grow and none repeats.
    for kinds in {kinds for kinds, _ in rows}:
        sizes = [size for of, size in rows if of == kinds]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert {kinds for kinds, _ in rows} == {"", "location,relation,unanswerable"}


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
        assert row["question_only_accuracy"] == result["question_only_by_seed"]["0"]
    last = four[-1]
    assert set(last["test_accuracy_by_kind"]) <= {"location", "relation", "exist", "count", "unanswerable"}
    assert 0.0 <= last["train_accuracy"] <= 1.0
    assert 0.0 <= result["question_only_accuracy"] <= 1.0
    assert result["config"]["model.profile"] == "tiny" and result["config"]["clients.count"] == 1
    assert result["config"]["points"]["memorisation-rows-8"] == {"data.train_limit": 8, "train.batch_size": 4,
                                                                 "train.steps_per_round": 2, "train.rounds": 2}
    assert {row["seed"] for row in rows} == {0}
    assert [(e["point"], e["seeds"], e["epochs"]) for e in result["across_seeds"]] == [
        ("memorisation-rows-4", [0], 4.0), ("memorisation-rows-8", [0], 2.0)]
    json.dumps(result)  # what --write stores
    # The last epochs' result is where the sweep finds it: `qpriv-sweep run` on the folder replays nothing.
    sweep = load_sweep(preset, out=out)
    for point in sweep.points:
        assert run_state(point)["state"] == "finished"
        assert attack_done(point, "mia_loss")
    # Measured again: a round the run is past comes back as first recorded, the last one is measured again.
    again = M.measure_memorisation(preset, out=out, fractions=(0.5,), processes=1, evaluate=False, progress=False,
                                   points=["*rows-8"])
    assert [(r["point"], r["rounds"]) for r in again["points"]] == [("memorisation-rows-8", r) for r in (0, 1, 2)]
    assert again["runs"][0]["skipped_rounds"] == [1]
    assert again["points"][1] == eight[1]
    # At another seed: its own sweep folder, its own data and adapters.
    other = M.measure_memorisation(preset, out=out, seeds=[3], fractions=(), processes=1, evaluate=False,
                                   progress=False, points=["*rows-4"])
    assert [(r["seed"], r["rounds"]) for r in other["points"]] == [(3, 0), (3, 4)]
    assert (tmp_path / "sweep-seed3" / "runs" / "memorisation-rows-4" / "status.json").is_file()
    assert other["question_only_by_seed"].keys() == {"3"}
    with pytest.raises(ValueError, match="seeds"):
        M.measure_memorisation(preset, out=out, seeds=[], progress=False)


def _row(point, seed, epochs, auc, accuracy=0.7, members=16):
    return {"point": point, "seed": seed, "train_rows": members, "epochs": epochs, "mia_auc": auc,
            "mia_auc_low": auc - 0.1, "mia_auc_high": min(1.0, auc + 0.1), "test_accuracy": accuracy,
            "members": members, "non_members": members}


def test_the_acceptance_reads_the_mean_over_seeds_at_each_points_last_epochs():
    rows = [_row("rows-16", seed, 0.0, 0.5) for seed in (0, 1, 2)]
    # Seed 2 memorises less: rows-16's best seed alone passes, its mean over seeds does not.
    rows += [_row("rows-16", 0, 100.0, 0.99), _row("rows-16", 0, 400.0, 0.95), _row("rows-16", 1, 400.0, 0.93),
             _row("rows-16", 2, 400.0, 0.79)]
    summary = M.summarise(rows, {0: 0.35, 1: 0.36, 2: 0.37})
    (entry,) = summary["across_seeds"]
    assert entry["seeds"] == [0, 1, 2] and entry["epochs"] == 400.0
    assert entry["mia_auc_by_seed"] == [0.95, 0.93, 0.79]
    assert entry["mia_auc"] == pytest.approx(0.89)
    assert 0.79 <= entry["mia_auc_low"] < entry["mia_auc"] < entry["mia_auc_high"] <= 0.95
    assert entry["question_only_accuracy"] == pytest.approx(0.36) and entry["n"] == "3 seeds × 16 members a side"
    assert not summary["reached_target"] and summary["best_point"] == "rows-16"
    # rows-8 clears the target on the mean, but a point that answers no better than the baseline is no candidate.
    rows += [_row("rows-8", seed, 400.0, auc, members=8) for seed, auc in ((0, 0.97), (1, 0.95), (2, 0.91))]
    rows += [_row("rows-4", seed, 400.0, 1.0, accuracy=0.3, members=4) for seed in (0, 1, 2)]
    summary = M.summarise(rows, {0: 0.35, 1: 0.36, 2: 0.37})
    assert summary["reached_target"] and summary["best_point"] == "rows-8"
    assert summary["best_auc"] == pytest.approx(0.9433, abs=1e-4)
    # One seed: the interval is the row's own (over the scored rows), not a bootstrap of one value.
    single = M.summarise([_row("rows-32", 0, 400.0, 0.85)], {0: 0.35})["across_seeds"][0]
    assert (single["mia_auc_low"], single["mia_auc_high"]) == (pytest.approx(0.75), pytest.approx(0.95))
    # A row carries the baseline of its own test rows (a point of other question kinds): it counts, not the seed's.
    unsure = [{**_row("unsure", seed, 400.0, 0.99), "question_only_accuracy": 0.75} for seed in (0, 1, 2)]
    summary = M.summarise(rows + unsure, {0: 0.35, 1: 0.36, 2: 0.37})
    assert {e["point"]: e["question_only_accuracy"] for e in summary["across_seeds"]}["unsure"] == pytest.approx(0.75)
    assert summary["best_point"] == "rows-8"


def test_writing_a_measurement_keeps_the_other_points_and_seeds_and_summarises_them_all(tmp_path):
    path = tmp_path / "testbed.json"
    path.write_text(json.dumps({"parts": {"accuracy": {}}, "memorisation": {
        "points": [_row("rows-16", 0, 400.0, 0.95), {k: v for k, v in _row("rows-32", 0, 400.0, 0.85, members=32).items() if k != "seed"},
                   _row("rows-8", 0, 400.0, 0.5, members=8)],
        "question_only_by_seed": {"0": 0.35}, "config": {"points": {"rows-32": {"data.train_limit": 32}}}}}))
    measured = {"points": [_row("rows-16", 1, 400.0, 0.93), _row("rows-8", 0, 400.0, 0.97, members=8)],
                "question_only_by_seed": {"1": 0.36}, "config": {"points": {"rows-16": {"data.train_limit": 16}}},
                "wall_seconds": 1.0}
    M.merge_measurement(path, measured)
    data = json.loads(path.read_text())
    assert data["parts"] == {"accuracy": {}}
    kept = {(row["point"], row["seed"]): row["mia_auc"] for row in data["memorisation"]["points"]}
    assert [e["point"] for e in data["memorisation"]["across_seeds"]] == ["rows-8", "rows-16", "rows-32"]
    # rows-8 at seed 0 was measured again: the new row replaces the old; a row without a seed is seed 0's.
    assert kept == {("rows-16", 0): 0.95, ("rows-32", 0): 0.85, ("rows-16", 1): 0.93, ("rows-8", 0): 0.97}
    by_point = {e["point"]: e for e in data["memorisation"]["across_seeds"]}
    assert by_point["rows-16"]["seeds"] == [0, 1] and by_point["rows-16"]["mia_auc"] == pytest.approx(0.94)
    assert data["memorisation"]["question_only_by_seed"] == {"0": 0.35, "1": 0.36}
    assert data["memorisation"]["config"]["points"].keys() == {"rows-16", "rows-32"}
    assert data["memorisation"]["wall_seconds"] == 1.0


def test_the_command_writes_a_measurement_of_points_of_other_question_kinds_alone(tmp_path, monkeypatch, capsys):
    """Points drawn from chosen question kinds carry their own baselines: the summary then has no
    all-kinds baseline, and the command still prints and writes it."""
    rows = [{**_row("unsure", seed, 400.0, 0.99), "question_only_accuracy": 0.27} for seed in (0, 1)]
    measured = {"points": rows, **M.summarise(rows, {}), "config": {"points": {"unsure": {}}}, "wall_seconds": 1.0}
    monkeypatch.setattr(M, "measure_memorisation", lambda *args, **kwargs: measured)
    results = tmp_path / "testbed.json"
    assert M.main(["--seeds", "0,1", "--write", "--results", str(results)]) == 0
    assert "(question-only 0.27)" in capsys.readouterr().out
    assert json.loads(results.read_text())["memorisation"]["best_point"] == "unsure"
