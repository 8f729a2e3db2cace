"""Sweeps: a file's points and their validation, before any run; and the shipped smoke sweep run
in process, resumed, and drawn by the results notebook headless (what CI runs)."""

import json
import os
import shutil
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from attacks.metrics import puri
from pruning import POLICIES
from sims import archive as A
from analysis import tables as T
from analysis.runs import NO_DEFENSE, load_results
from sims.sweep import SweepError, attack_done, load_sweep, read_record, restore_archived, run_sweep, status_rows
from sims.sweep import main as sweep_main

REPOSITORY = Path(__file__).parents[2]
SMOKE = REPOSITORY / "sims" / "sweeps" / "smoke.toml"
NOTEBOOK = REPOSITORY / "notebooks" / "results.ipynb"
SIM = str(REPOSITORY / "sims" / "usl_easyvqa")

TINY = """
[sweep]
sim = "{sim}"
runner = "inprocess"

[fixed]
"model.profile" = "tiny"
"data.train_limit" = 12
"data.test_limit" = 4
"train.rounds" = 1
"train.steps_per_round" = 1
"train.batch_size" = 4
"eval.batch_size" = 4
"""


def sweep_file(tmp_path: Path, body: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text(TINY.format(sim=SIM) + body)
    return path


def refusal(tmp_path: Path, body: str) -> str:
    with pytest.raises(SweepError) as error:
        load_sweep(sweep_file(tmp_path, body), out=tmp_path / "out")
    return str(error.value)


def test_points_are_the_product_of_the_axes_times_each_zip_group(tmp_path):
    sweep = load_sweep(sweep_file(tmp_path, """
[[grid]]
name = "grid"
fixed = { "threat.model" = "passive" }
[grid.product]
paradigm = ["sl", "usl"]
"train.lr" = [0.001, 0.0005]
[[grid.zip]]
label = ["off", "half"]
"pruning.policy" = ["off", "fixed"]
"pruning.ratio" = [0.0, 0.5]
"""), out=tmp_path / "out")
    assert len(sweep.points) == 2 * 2 * 2
    names = [p.name for p in sweep.points]
    assert names[:2] == ["grid-sl-0.001-off", "grid-sl-0.001-half"]
    half = sweep.points[1]
    assert (half.config.pruning.policy, half.config.pruning.ratio, half.config.threat.model) == ("fixed", 0.5, "passive")
    assert half.folder == tmp_path / "out" / "runs" / "grid-sl-0.001-half"
    assert half.config.model.profile == "tiny"  # the file's fixed keys over the app's defaults


def test_a_seeds_axis_runs_every_point_at_each_seed_with_every_seed_of_the_run_set(tmp_path):
    body = "\n[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\", \"usl\"] }\n"
    sweep = load_sweep(sweep_file(tmp_path, body), out=tmp_path / "out")
    assert len(sweep.points) == 2
    seeded = sweep_file(tmp_path, body, name="seeded.toml")
    seeded.write_text(seeded.read_text().replace('runner = "inprocess"', 'runner = "inprocess"\nseeds = [0, 1, 2]'))
    sweep = load_sweep(seeded, out=tmp_path / "out-seeded")
    assert [p.name for p in sweep.points] == ["g-sl-s0", "g-sl-s1", "g-sl-s2", "g-usl-s0", "g-usl-s1", "g-usl-s2"]
    last = sweep.points[-1].config
    assert (last.model.seed, last.data.seed, last.privacy.seed) == (2, 2, 2)


@pytest.mark.parametrize("seeds, expected", [("[0, 0]", "repeats a seed"), ("[-1]", "non-negative integers"),
                                             ("3", "a list of distinct")])
def test_a_bad_seeds_axis_is_refused_naming_what_is_allowed(tmp_path, seeds, expected):
    path = sweep_file(tmp_path, "\n[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n")
    path.write_text(path.read_text().replace('runner = "inprocess"', f'runner = "inprocess"\nseeds = {seeds}'))
    with pytest.raises(SweepError, match=f"sweep.seeds: .*{expected}"):
        load_sweep(path, out=tmp_path / "out")
    path.write_text(path.read_text().replace(f"seeds = {seeds}", "seeds = [0, 1]").replace(
        'product = { paradigm = ["sl"] }', 'product = { "model.seed" = [3] }'))
    with pytest.raises(SweepError, match=r"\['model.seed'\] set while sweep.seeds"):
        load_sweep(path, out=tmp_path / "out")


def test_a_yaml_sweep_file_gives_the_same_points_as_its_toml(tmp_path):
    toml = sweep_file(tmp_path, "[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\", \"usl\"] }\n")
    yaml = tmp_path / "sweep.yaml"
    yaml.write_text(f"""
sweep: {{sim: "{SIM}", runner: inprocess}}
fixed: {{model.profile: tiny, data.train_limit: 12, data.test_limit: 4, train.rounds: 1,
        train.steps_per_round: 1, train.batch_size: 4, eval.batch_size: 4}}
grid:
  - name: g
    product: {{paradigm: [sl, usl]}}
""")
    from_toml, from_yaml = (load_sweep(path, out=tmp_path / "out") for path in (toml, yaml))
    assert [(p.name, p.config) for p in from_yaml.points] == [(p.name, p.config) for p in from_toml.points]


@pytest.mark.parametrize("body, expected", [
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[typo]\nx = 1\n", "unknown key 'typo'"),
    ("", "empty grid"),
    ("[[grid]]\nname = \"g\"\n", "grid 'g': empty grid"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [] }\n", "product.paradigm: must be a non-empty list"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\", \"xl\"] }\n", "point g-xl: run config paradigm='xl'"),
    ("[[grid]]\nname = \"g\"\nproduct = { \"train.lrr\" = [0.1] }\n", "point g-0.1: run config train.lrr"),
    ("[[grid]]\nname = \"g\"\n[[grid.zip]]\nparadigm = [\"sl\", \"usl\"]\n\"train.lr\" = [0.1]\n", "lists of one length"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.forra]\n", "attacks.forra: no such attack"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.fora]\noptions = { steps = 3 }\n",
     "attacks.fora.options: fora: unknown option 'steps'"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.fora]\nwhere = { \"threat.mode\" = [\"passive\"] }\n",
     "unknown run-config key 'threat.mode'"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\", \"sl\"] }\n", "points share a run name"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.actinv_masked]\nattack = \"actinvv\"\n",
     "attacks.actinv_masked: attack = 'actinvv': no such attack"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.actinv_masked]\n",
     "attacks.actinv_masked: no such attack"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.fora]\nattack = \"actinv\"\n",
     "attacks.fora: the label names the attack 'fora' but replays 'actinv'"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.\"a/b\"]\nattack = \"actinv\"\n",
     "attacks.a/b: a label is letters"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.actinv_masked]\nattack = \"actinv\"\n"
     "options = { decoder_steps = 3 }\n", "attacks.actinv_masked.options: actinv: unknown option 'decoder_steps'"),
    ("[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n[attacks.fora]\noptions = { decoder_steps = -3 }\n",
     "attacks.fora.options: fora: option decoder_steps=-3 is not allowed"),
])
def test_a_bad_sweep_file_is_refused_naming_the_point_and_the_key(tmp_path, body, expected):
    assert expected in refusal(tmp_path, body)


def test_an_attack_table_may_replay_a_registered_attack_under_a_label_of_its_own(tmp_path):
    sweep = load_sweep(sweep_file(tmp_path, """
[[grid]]
name = "g"
product = { paradigm = ["sl"] }
[attacks.actinv]
options = { iterations = 5 }
[attacks.actinv_masked]
attack = "actinv"
options = { iterations = 5, mask_zeros = true }
"""), out=tmp_path / "out")
    plans = {plan.name: plan for plan in sweep.attacks}
    assert (plans["actinv"].attack, plans["actinv_masked"].attack) == ("actinv", "actinv")
    assert plans["actinv_masked"].options == {"iterations": 5, "mask_zeros": True}


def test_an_attack_table_may_replay_one_round_of_runs_that_store_it(tmp_path):
    head = '[[grid]]\nname = "g"\nproduct = { paradigm = ["usl"] }\nfixed = { "threat.record_rounds" = "1,3" }\n'
    sweep = load_sweep(sweep_file(tmp_path, head + '[attacks.fora-late]\nattack = "fora"\nround = 3\n'),
                       out=tmp_path / "out")
    assert [(plan.attack, plan.round) for plan in sweep.attacks] == [("fora", 3)]
    assert "attacks.fora-late.round = 2, which its run does not store" in refusal(
        tmp_path, head + '[attacks.fora-late]\nattack = "fora"\nround = 2\n')
    assert "attacks.mia-late.round: mia reads model" in refusal(
        tmp_path, head + '[attacks.mia-late]\nattack = "mia"\nround = 3\n')
    assert "attacks.fora-late.round: 0; allowed: a round number >= 1" in refusal(
        tmp_path, head + '[attacks.fora-late]\nattack = "fora"\nround = 0\n')


def test_an_attack_table_may_fit_on_more_auxiliary_rows_than_the_run_names(tmp_path):
    head = '[[grid]]\nname = "g"\nproduct = { paradigm = ["usl"] }\n'
    sweep = load_sweep(sweep_file(tmp_path, head + '[attacks.cut_probe]\naux_limit = 3000\n[attacks.fora]\n'),
                       out=tmp_path / "out")
    assert {plan.name: plan.aux_limit for plan in sweep.attacks} == {"cut_probe": 3000, "fora": None}
    assert "attacks.cut_probe.aux_limit: 0; allowed: a number of auxiliary rows >= 1" in refusal(
        tmp_path, head + '[attacks.cut_probe]\naux_limit = 0\n')


def test_a_list_of_alphas_prepares_one_dtp_each_and_a_point_reads_its_own(tmp_path):
    grid = """
[dtp]
profile = "tiny"
model_stage = "random"
alpha = [0, 1]
[[grid]]
name = "alpha"
[[grid.zip]]
label = ["dtp-a0", "dtp-a1", "random"]
"pruning.policy" = ["dtp", "dtp", "random"]
"pruning.alpha" = [0.0, 1.0, 1.0]
"""
    sweep = load_sweep(sweep_file(tmp_path, grid), out=tmp_path / "out")
    dtp = tmp_path / "out" / "dtp"
    assert {folder: settings.alpha for folder, settings in sweep.dtp.items()} == {dtp / "alpha-0": 0.0,
                                                                                 dtp / "alpha-1": 1.0}
    assert [p.overrides["pruning.artifacts"] for p in sweep.points] == [str(dtp / "alpha-0"), str(dtp / "alpha-1"),
                                                                        str(dtp / "alpha-1")]
    assert "pruning.alpha=0.5 has no DTP preparation; dtp.alpha prepares 0, 1" in refusal(
        tmp_path, grid.replace("[0.0, 1.0, 1.0]", "[0.0, 1.0, 0.5]"))
    assert "dtp.alpha: [1, 1]" in refusal(tmp_path, grid.replace("alpha = [0, 1]", "alpha = [1, 1]"))


def test_overrides_set_a_key_on_every_point_over_the_file_and_its_runs_are_judged_by_them(tmp_path):
    body = "[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\", \"usl\"] }\n"
    path = sweep_file(tmp_path, body)
    seeded = load_sweep(path, out=tmp_path / "out", overrides={"data.seed": 3, "model.seed": 3})
    assert [(p.config.data.seed, p.config.model.seed) for p in seeded.points] == [(3, 3), (3, 3)]
    assert [p.name for p in seeded.points] == ["g-sl", "g-usl"]
    point = seeded.points[0]
    point.folder.mkdir(parents=True)
    (point.folder / "config.json").write_text(json.dumps({"config": point.config.to_flat(), "fingerprint": "x"}))
    (point.folder / "committed.json").write_text(json.dumps({"round": 1}))
    # The same folder is that seed's: loaded with the overrides it is accepted, without them refused.
    load_sweep(path, out=tmp_path / "out", overrides={"data.seed": 3, "model.seed": 3})
    assert "another value of data.seed, model.seed" in refusal(tmp_path, body)


def test_a_point_whose_config_changed_since_its_run_folder_was_written_is_refused(tmp_path):
    body = "[[grid]]\nname = \"g\"\nproduct = { paradigm = [\"sl\"] }\n"
    point = load_sweep(sweep_file(tmp_path, body), out=tmp_path / "out").points[0]
    point.folder.mkdir(parents=True)
    written = {**point.config.to_flat(), "train.lr": 0.123}
    (point.folder / "config.json").write_text(json.dumps({"config": written, "fingerprint": "other"}))
    (point.folder / "committed.json").write_text(json.dumps({"round": 1}))
    assert "another value of train.lr" in refusal(tmp_path, body)
    # A key that may change on resume (more rounds) is not a change.
    written = {**point.config.to_flat(), "train.rounds": 7}
    (point.folder / "config.json").write_text(json.dumps({"config": written, "fingerprint": "other"}))
    load_sweep(sweep_file(tmp_path, body), out=tmp_path / "out")


def test_a_failed_run_is_recorded_with_its_reason_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # No mini model in this (empty) cache: that point fails fast, the tiny one still runs.
    monkeypatch.setenv("QPRIV_CACHE_DIR", str(tmp_path / "empty-cache"))
    sweep = load_sweep(sweep_file(tmp_path, """
[[grid]]
name = "g"
[[grid.zip]]
paradigm = ["cl", "cl"]
"clients.count" = [1, 1]
"model.profile" = ["mini", "tiny"]
"""), out=tmp_path / "out")
    logged = []
    states = run_sweep(sweep, progress=False, log=logged.append)
    assert states == {"g-cl-1-mini": "failed", "g-cl-1-tiny": "finished"}
    record = json.loads((tmp_path / "out" / "points" / "g-cl-1-mini.json").read_text())
    assert record["run"]["state"] == "failed" and "qpriv-mini build" in record["run"]["error"]
    assert logged and "g-cl-1-mini" in logged[0]
    rows = {row["point"]: row for row in status_rows(sweep)}
    assert rows["g-cl-1-mini"]["run"] == "failed"
    assert "ModelNotAvailableError: the mini model (base stage) is not built" in rows["g-cl-1-mini"]["reason"]
    assert rows["g-cl-1-tiny"]["run"] == "finished"
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["starts"][0]["commit"]


def test_defended_runs_and_labelled_results_load_as_their_own_rows(tmp_path):
    def run_folder(name, defenses, results):
        folder = tmp_path / "runs" / name
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "attacks").mkdir()
        config = {"paradigm": "usl", "pruning.policy": "off", "pruning.ratio": 0.0, "threat.model": "passive",
                  "privacy.defenses": defenses, "privacy.sparsify.ratio": 0.7, "privacy.sparsify.level": "element",
                  "privacy.noise.variance": 0.1}
        (folder / "config.json").write_text(json.dumps({"config": config, "fingerprint": name}))
        (folder / "status.json").write_text(json.dumps({"state": "finished"}))
        (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "test_accuracy": 0.5, "test_count": 8}) + "\n")
        for label, base, psnr in results:
            (folder / "attacks" / f"{label}.json").write_text(json.dumps(
                {"attack": label, "metrics": {"psnr": psnr}, "details": {"base_attack": base}}))

    run_folder("plain", "", [("fora", "fora", 20.0)])
    run_folder("sparse", "sparsify,noise", [("fora", "fora", 15.0), ("fora_adaptive", "fora", 18.0)])
    loaded = load_results(tmp_path)
    runs = loaded.runs.set_index("run")
    assert runs.loc["sparse", "defenses"] == "sparsify+noise" and runs.loc["plain", "defenses"] == NO_DEFENSE
    # Each defense's strength, and its other options where they differ from the defaults.
    assert runs.loc["sparse", "defense_setting"] == "sparsify(ratio=0.7)+noise(variance=0.1)"
    run_folder("noisy", "noise", [("fora", "fora", 17.0)])
    noisy = load_results(tmp_path).runs.set_index("run").loc["noisy"]
    # A single defense's series leaves its strength out: the frontier's x.
    assert (noisy["defense_series"], noisy["defense_strength"]) == ("noise", 0.1)
    shutil.rmtree(tmp_path / "runs" / "noisy")
    assert sorted(loaded.attacks["attack"]) == ["fora", "fora", "fora_adaptive"]
    frontier = T.defense_frontier(loaded, "fora_adaptive")
    assert list(frontier["run"]) == ["sparse"] and list(frontier["psnr"]) == [18.0]
    assert set(T.defense_frontier(loaded, "fora")["defenses"]) == {NO_DEFENSE, "sparsify+noise"}
    table = T.defense_table(loaded).set_index("defenses")
    assert table.loc["sparsify+noise", ["fora_psnr", "fora_adaptive_psnr"]].tolist() == [15.0, 18.0]
    assert list(T.attack_table(loaded)["fora_psnr"]) == [20.0]  # undefended runs only


def test_the_loader_lists_a_run_folder_missing_or_tearing_a_file_as_incomplete(tmp_path):
    for name in ("no-status", "torn-metrics"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps({"config": {"paradigm": "sl"}, "fingerprint": "x"}))
    (tmp_path / "torn-metrics" / "status.json").write_text(json.dumps({"state": "running"}))
    (tmp_path / "torn-metrics" / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2, "test_acc')
    loaded = load_results(tmp_path)
    assert loaded.runs.empty
    reasons = dict(zip(loaded.incomplete["run"], loaded.incomplete["reason"]))
    assert reasons == {"no-status": "no status.json", "torn-metrics": "metrics.jsonl line 2 is torn"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The shipped smoke sweep, run in process: every point and every attack that applies (about
    30 s on 2 cores, shared by the tests that read it)."""
    out = tmp_path_factory.mktemp("smoke")
    exit_code = sweep_main(["run", str(SMOKE), "--out", str(out), "--no-progress"])
    return load_sweep(SMOKE, out=out), exit_code


def test_the_smoke_sweep_finishes_every_point_and_replays_every_attack_that_applies(smoke):
    sweep, exit_code = smoke
    assert exit_code == 0
    loaded = load_results(sweep.folder)
    assert loaded.incomplete.empty and len(loaded.runs) == len(sweep.points)
    assert set(loaded.finished()["paradigm"]) == {"cl", "fl", "sl", "usl", "mtv"}
    attacks = loaded.attacks
    assert set(attacks[attacks["threat"] == "passive"]["attack"]) == {"fora", "sara", "sara_adaptive", "actinv", "idlg",
                                                                      "mia", "mtv_mia"}
    assert set(attacks[attacks["paradigm"] == "mtv"]["attack"]) == {"mtv_mia"}
    # The adaptive SARA refitted on the run's own edge (the ToMe point).
    edge_point = next(p for p in sweep.points if p.name == "vision-edge-usl-tome-4")
    adaptive = json.loads((edge_point.folder / "attacks" / "sara_adaptive.json").read_text())
    assert adaptive["details"]["adaptive_to"] == ["tome"]
    assert set(attacks[attacks["threat"] == "active-fsha"]["attack"]) == {"fsha"}
    # The pruned points ran with the sweep's prepared DTP artefacts.
    dtp = loaded.runs[loaded.runs["policy"] == "dtp"].iloc[0]
    assert dtp["config"]["pruning.artifacts"] == str(*sweep.dtp)
    assert dtp["kept_tokens_mean"] < loaded.runs[loaded.runs["policy"] == "off"].iloc[0]["kept_tokens_mean"]


def test_a_second_start_skips_what_is_done_and_resumes_an_interrupted_run(smoke):
    sweep, _ = smoke
    point = next(p for p in sweep.points if p.config.threat.model == "passive")
    results = point.folder / "attacks"
    before = {path.name: path.stat().st_mtime_ns for path in results.iterdir()}
    metrics = (point.folder / "metrics.jsonl").read_text()
    (results / "mia.json").unlink()
    (point.folder / "status.json").write_text(json.dumps({"state": "running", "round": 1}))  # killed mid-run
    again = load_sweep(SMOKE, out=sweep.folder)
    assert set(run_sweep(again, progress=False).values()) == {"finished"}
    after = {path.name: path.stat().st_mtime_ns for path in results.iterdir()}
    assert {name for name in after if after[name] != before.get(name)} == {"mia.json", "mia.safetensors"}
    # Every round had been committed: the resumed run trains nothing again.
    assert (point.folder / "metrics.jsonl").read_text() == metrics
    assert json.loads((point.folder / "status.json").read_text())["state"] == "finished"


def test_an_attack_result_made_with_other_options_is_refused_naming_them(smoke, tmp_path):
    sweep, _ = smoke
    text = SMOKE.read_text()
    changed = text.replace("substitute_steps = 4, decoder_steps = 8", "substitute_steps = 4, decoder_steps = 9")
    assert changed != text
    (tmp_path / "smoke.toml").write_text(changed)
    with pytest.raises(SweepError, match=r"other attacks.fora.options \(decoder_steps\)"):
        load_sweep(tmp_path / "smoke.toml", out=sweep.folder)


LABELLED = """
[attacks.actinv_masked]
attack = "actinv"
options = { iterations = 5, max_transfers = 1, refine_candidates = 0, mask_zeros = true }
where = { "threat.model" = ["passive"], paradigm = ["usl"] }
"""


def test_a_labelled_replay_lands_beside_the_plain_one_under_its_label(smoke, tmp_path):
    sweep, _ = smoke
    labelled = tmp_path / "smoke.toml"
    labelled.write_text(SMOKE.read_text() + LABELLED)
    passive = [p for p in sweep.points if p.config.threat.model == "passive" and p.config.paradigm == "usl"]
    plain_before = {p.name: (p.folder / "attacks" / "actinv.json").stat().st_mtime_ns for p in passive}
    again = load_sweep(labelled, out=sweep.folder)
    assert set(run_sweep(again, progress=False).values()) == {"finished"}
    for point in passive:
        saved = json.loads((point.folder / "attacks" / "actinv_masked.json").read_text())
        assert saved["attack"] == "actinv_masked" and saved["details"]["base_attack"] == "actinv"
        assert saved["details"]["options"]["mask_zeros"] is True and "token_recall" in saved["metrics"]
        assert (point.folder / "attacks" / "actinv.json").stat().st_mtime_ns == plain_before[point.name]
        assert not [p for p in (point.folder / "attacks").iterdir() if p.name.startswith(".")]  # no scratch left
        record = json.loads(sweep.point_record(point).read_text())["attacks"]["actinv_masked"]
        assert (record["state"], record["attack"]) == ("finished", "actinv")
    assert not any((p.folder / "attacks" / "actinv_masked.json").exists() for p in sweep.points if p not in passive)
    loaded = load_results(sweep.folder)
    rows = loaded.attacks[loaded.attacks["attack"] == "actinv_masked"]
    assert len(rows) == len(passive) and set(rows["base_attack"]) == {"actinv"}
    table = T.attack_table(loaded)
    assert {"actinv_token_recall", "actinv_masked_token_recall"} <= set(table.columns)
    assert len(T.defense_frontier(loaded, "actinv_masked", "token_recall")) == len(passive)
    assert {"actinv_token_recall", "actinv_masked_token_recall"} <= set(T.defense_table(loaded).columns)
    # The label's record holds what it replayed: another attack under the same label is refused.
    (tmp_path / "other.toml").write_text(SMOKE.read_text() + LABELLED.replace('attack = "actinv"', 'attack = "mia"')
                                         .replace("options = { iterations = 5, max_transfers = 1, refine_candidates = 0, "
                                                  "mask_zeros = true }", ""))
    with pytest.raises(SweepError, match=r"its actinv_masked result was made with attack 'actinv'"):
        load_sweep(tmp_path / "other.toml", out=sweep.folder)


def test_the_results_notebook_executes_headless_on_the_smoke_sweep_and_draws_every_figure(smoke, tmp_path):
    sweep, _ = smoke
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    os.environ["QPRIV_RESULTS"] = str(sweep.folder)
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(REPOSITORY)}}).execute()
    finally:
        del os.environ["QPRIV_RESULTS"]
    # A figure cell whose sweep is not loaded prints what is missing instead; the smoke sweep feeds at least seven.
    figures = [cell for cell in notebook.cells if cell.cell_type == "code"
               and "show(figure)" in (line.strip() for line in cell.source.splitlines())]
    drawn = [cell for cell in figures if any("image/png" in output.get("data", {}) for output in cell.outputs)]
    assert len(drawn) >= 7, [cell.source[:80] for cell in figures if cell not in drawn]
    # The smoke sweep runs each point once: every claim is judged not testable, saying why.
    claims = next(c for c in notebook.cells if c.cell_type == "code" and "qpriv_vl.claims" in c.source)
    assert "not testable" in json.dumps(claims.outputs) and "holds" not in json.dumps(claims.outputs)
    # The smoke sweep's defended runs: the frontier is drawn, the defense claims are checked.
    frontier = next(c for c in notebook.cells if c.cell_type == "code" and "T.defense_frontier" in c.source)
    assert any("image/png" in output.get("data", {}) for output in frontier.outputs)
    defense_claims = next(c for c in notebook.cells if c.cell_type == "code" and "activation_inversion.claims" in c.source)
    assert "masked-cosine ActInv" in json.dumps(defense_claims.outputs)
    # The vision edge: SARA's placement against accuracy drawn, PURI tabled for the ToMe point.
    edge = next(c for c in notebook.cells if c.cell_type == "code" and "T.puri_table" in c.source)
    assert any("image/png" in output.get("data", {}) for output in edge.outputs)
    assert "tome(r=4)" in json.dumps(edge.outputs)
    edge_claims = next(c for c in notebook.cells if c.cell_type == "code" and "vision_edge.claims" in c.source)
    assert "token shuffling defeats a decoder" in json.dumps(edge_claims.outputs)
    # Task vectors: the smoke sweep's two releases drawn against ε, seed 003's claims checked, the audit tabled.
    mtv = next(c for c in notebook.cells if c.cell_type == "code" and "dp_mtv.claims" in c.source)
    assert any("image/png" in output.get("data", {}) for output in mtv.outputs)
    assert "most of MTV's gain" in json.dumps(mtv.outputs) and "audit_auc" in json.dumps(mtv.outputs)


def test_the_shipped_sweeps_validate(tmp_path):
    for name in ("paradigms", "pruning-attacks", "defenses", "vision-edge", "federated-privacy", "dpmtv", "smoke",
                 "memorisation", "memorisation-audit", "pruning-mia"):
        sweep = load_sweep(REPOSITORY / "sims" / "sweeps" / f"{name}.toml", out=tmp_path / name)
        assert sweep.points
    # The pruning sweep runs every registered policy but the oracle (its table covers only the samples
    # DTP's preparation searched), each DTP point on the preparation of its own α.
    sweep = load_sweep(REPOSITORY / "sims" / "sweeps" / "pruning-attacks.toml", out=tmp_path / "p")
    assert {p.overrides["pruning.policy"] for p in sweep.points} == set(POLICIES.names()) - {"oracle"}
    dtp = [p for p in sweep.points if p.overrides["pruning.policy"] == "dtp"]
    alphas = [p.overrides.get("pruning.alpha", 1.0) for p in dtp]
    assert set(alphas) == {0.0, 0.5, 1.0}
    assert all(p.overrides["pruning.artifacts"].endswith(f"alpha-{alpha:g}") for p, alpha in zip(dtp, alphas))


def test_a_sweep_prepares_its_positionless_edge_once_and_its_points_run_it(tmp_path):
    sweep = load_sweep(sweep_file(tmp_path, """
[positionless.k1]
profile = "tiny"
stage = "random"
rows = 8
held_out = 4
steps = 2

[[grid]]
name = "edge"
fixed = { paradigm = "sl", "model.stage" = "random" }
[[grid.zip]]
label = ["positionless", "positionless-shuffle"]
"privacy.defenses" = ["positionless", "positionless,shuffle"]
"privacy.positionless.artifact" = ["k1", "k1"]
"""), out=tmp_path / "out")
    edge = tmp_path / "out" / "positionless" / "k1"
    assert all(p.overrides["privacy.positionless.artifact"] == str(edge) for p in sweep.points)
    # Until the edge exists the points are checked without it, and status says so.
    assert {row["reason"] for row in status_rows(sweep)} == {
        "its positionless edge not prepared yet: attacks listed as without them"}
    logged = []
    assert run_sweep(sweep, progress=False, log=logged.append) == {
        "edge-positionless": "finished", "edge-positionless-shuffle": "finished"}
    assert (edge / "manifest.json").is_file() and sum("preparing" in line for line in logged) == 1
    for point in sweep.points:
        assert point.config.privacy.positionless.artifact == str(edge)
        described = json.loads((point.folder / "status.json").read_text())["defenses"]
        assert described[0] == {"name": "positionless", "stage": "edge", "options": {"artifact": str(edge)}}
    assert {row["reason"] for row in status_rows(sweep)} == {""}
    assert "positionless.k1: steps 0" in refusal(tmp_path, """
[positionless.k1]
profile = "tiny"
steps = 0
[[grid]]
name = "g"
""")


def test_puri_reads_each_defended_image_attack_against_its_undefended_run(smoke):
    sweep, _ = smoke
    loaded = load_results(sweep.folder)
    table = T.puri_table(loaded)
    edge = table[table["defense_setting"] == "tome(r=4)"]
    assert list(edge["attack"]) == ["sara_adaptive"]
    row = edge.iloc[0]
    # The reference is the undefended USL run of the same policy, attacked by the base attack (SARA).
    attacks = loaded.attacks
    base = attacks[(attacks["attack"] == "sara") & (attacks["defenses"] == NO_DEFENSE) & (attacks["policy"] == "off")
                   & (attacks["paradigm"] == "usl")].iloc[0]
    expected = puri(row["test_accuracy"], base["test_accuracy"], {m: row[m] for m in ("ssim", "psnr", "fsim")},
                    {m: base[m] for m in ("ssim", "psnr", "fsim")})
    assert row["puri"] == pytest.approx(expected) and 0 <= row["puri"] <= 1
    best = T.best_by_puri(table)
    assert len(best) == len(best[["paradigm", "policy", "attack", "defense_series"]].drop_duplicates())


def test_an_archived_sweep_goes_on_on_a_new_machine_from_its_archive(smoke, tmp_path, monkeypatch):
    sweep, _ = smoke
    archive = tmp_path / "archive"
    # Started again with an archive, the finished sweep runs nothing and archives every point.
    again = load_sweep(SMOKE, out=sweep.folder)
    again.archive = archive
    assert set(run_sweep(again, progress=False).values()) == {"finished"}
    assert sorted(p.name for p in (archive / "runs").iterdir()) == sorted(p.name for p in sweep.points)
    assert sorted(p.stem for p in (archive / "points").iterdir()) == sorted(p.name for p in sweep.points)
    assert not list(archive.rglob("checkpoints")) and not list(archive.rglob("recording"))
    assert all(p.stat().st_size <= A.MAX_OUTPUT_BYTES for p in archive.rglob("*.safetensors"))
    # The archive reads as the sweep folder does: the same tables.
    here, there = load_results(sweep.folder), load_results(archive)
    assert there.incomplete.empty and len(there.runs) == len(sweep.points)
    columns = ["paradigm", "defense_setting", "test_accuracy", "fora_psnr", "actinv_token_recall"]
    pd.testing.assert_frame_equal(T.defense_table(here)[columns], T.defense_table(there)[columns])

    # A new machine (another sweep folder) restores every point and runs, fits and prepares nothing.
    def untouchable(*args, **kwargs):
        raise AssertionError("a restored point ran again")

    for name in ("_run_point", "replay", "fit_for_run", "prepare_dtp"):
        monkeypatch.setattr(f"sims.sweep.{name}", untouchable)
    fresh = load_sweep(SMOKE, out=tmp_path / "new-machine")
    fresh.archive = archive
    logged = []
    assert set(run_sweep(fresh, progress=False, log=logged.append).values()) == {"finished"}
    assert logged[0] == f"restored {len(sweep.points)} point(s) from {archive}"
    point = fresh.points[0]
    assert json.loads((point.folder / "config.json").read_text())["config"]["output.root"] == str(fresh.folder / "runs")
    # Both stamps name every machine's starts, the first machine's first.
    starts = json.loads((fresh.folder / "sweep.json").read_text())["starts"]
    assert starts == json.loads((archive / "sweep.json").read_text())["starts"]
    assert starts[:-1] == json.loads((sweep.folder / "sweep.json").read_text())["starts"]
    assert load_results(fresh.folder).runs["test_accuracy"].tolist() == here.runs["test_accuracy"].tolist()

    # Not restored: a point the archive holds in part (an attack missing), and one archived with
    # other settings than the file's now (it runs again, saying why).
    partial, stale = [p for p in sweep.points if p.config.threat.model == "passive"][:2]
    next((archive / "runs" / partial.name / "attacks").glob("*.json")).unlink()
    written = json.loads((archive / "runs" / stale.name / "config.json").read_text())
    written["config"]["train.lr"] = 0.5
    (archive / "runs" / stale.name / "config.json").write_text(json.dumps(written))
    third = load_sweep(SMOKE, out=tmp_path / "third-machine")
    third.archive = archive
    logged = []
    restored = restore_archived(third, log=logged.append)
    assert partial.name not in restored and stale.name not in restored
    assert len(restored) == len(sweep.points) - 2
    assert logged == [f"{stale.name}: not restored from {archive}: archived with another value of train.lr; it runs again"]
    assert not (third.folder / "runs" / stale.name).exists() and not (third.folder / "runs" / partial.name).exists()


def test_a_torn_point_record_or_attack_result_is_made_afresh_with_a_warning(tmp_path, caplog):
    sweep = load_sweep(sweep_file(tmp_path, """
[[grid]]
name = "g"
[[grid.zip]]
paradigm = ["cl"]
"clients.count" = [1]
"""), out=tmp_path / "out")
    point = sweep.points[0]
    sweep.point_record(point).parent.mkdir(parents=True)
    sweep.point_record(point).write_text('{"run": {"state": "fini')
    assert read_record(sweep, point) == {}
    assert f"its record {sweep.point_record(point)} is torn" in caplog.text
    load_sweep(sweep.file, out=sweep.folder)  # the sweep still loads
    # An attack result torn (by damage, or an older build's save) is not taken for done.
    result = point.folder / "attacks" / "fora.json"
    result.parent.mkdir(parents=True)
    result.write_text('{"attack": "fora", "metr')
    assert not attack_done(point, "fora") and f"its fora result {result} is torn" in caplog.text
    result.write_text('{"attack": "fora", "metrics": {}}')
    assert attack_done(point, "fora")
