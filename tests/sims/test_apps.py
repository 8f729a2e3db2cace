"""Every app declares every schema key (`--run-config` may only override declared keys), each value
declared once: `qpriv-apps` writes the table from the schema's defaults and the app's overrides."""

from pathlib import Path

import pytest

from config import SimConfig, load_config
from sims import apps as A
from sims.launch import app_config

KEYS = set(SimConfig().to_flat())
COMPONENTS = """# An app's own comment.
[project]
name = "x"

[tool.flwr.app.components]
serverapp = "strategies.app:app"
clientapp = "clients.worker:app"

"""


def make_app(root: Path, name: str, overrides: str, rest: str = "") -> Path:
    app = root / "sims" / name
    app.mkdir(parents=True)
    (app / "pyproject.toml").write_text(f'{COMPONENTS}[tool.qpriv.overrides]\n"output.name" = "{name}"\n{overrides}\n{rest}')
    return app


def test_every_app_is_current_and_declares_every_key():
    # The benchmarks' round-trip app runs the sims' ClientApp, which reads every key.
    apps = A.app_folders()
    assert {app.name for app in apps} >= {"usl_vqarad", "usl_easyvqa", "sl_easyvqa", "fl_easyvqa", "cl_easyvqa", "roundtrip_app"}
    assert list(A.stale(apps)) == [], "run qpriv-apps"
    for app in apps:
        config = app_config(app)
        assert set(config) == KEYS, app
        if app.parent.name == "sims":
            assert load_config(config).output.name == app.name


def test_a_new_app_gets_every_key_with_its_base_and_own_values_and_keeps_the_rest(tmp_path):
    make_app(tmp_path, "base", '"train.rounds" = 7\n"train.lr" = 0.5\n')
    app = make_app(tmp_path, "child", '"train.lr" = 0.25\n', rest='[tool.qpriv]\nbase = "../base"\n')
    before = (app / "pyproject.toml").read_text()
    text = A.written(app)
    assert text.startswith(before.rstrip() + "\n\n" + A.MARKER + "\n" + A.HEADER + "\n")
    (app / "pyproject.toml").write_text(text)
    config = app_config(app)
    assert set(config) == KEYS
    assert (config["output.name"], config["train.rounds"], config["train.lr"]) == ("child", 7, 0.25)
    assert config["train.steps_per_round"] == SimConfig().train.steps_per_round
    assert A.written(app) == text


def test_check_names_a_stale_app_and_a_run_rewrites_only_its_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(A, "ROOT", tmp_path)
    app = make_app(tmp_path, "stale", '"train.rounds" = 7\n')
    (app / "pyproject.toml").write_text((app / "pyproject.toml").read_text() + f'{A.HEADER}\n"train.rounds" = 3\n"gone" = 1\n')
    stale = (app / "pyproject.toml").read_text()
    assert A.main(["--check"]) == 1
    assert "sims/stale/pyproject.toml is not current" in capsys.readouterr().err
    assert (app / "pyproject.toml").read_text() == stale
    assert A.main([]) == 0
    text = (app / "pyproject.toml").read_text()
    assert text.startswith(stale[:stale.index(A.HEADER)]) and app_config(app)["train.rounds"] == 7 and "gone" not in app_config(app)
    assert A.main(["--check"]) == 0


@pytest.mark.parametrize(("overrides", "named"), [('"train.rounds" = 0', "train.rounds=0"), ('"trian.rounds" = 3', "trian.rounds")])
def test_an_override_the_schema_refuses_is_named_with_its_file(tmp_path, monkeypatch, capsys, overrides, named):
    monkeypatch.setattr(A, "ROOT", tmp_path)
    make_app(tmp_path, "wrong", overrides)
    assert A.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert "sims/wrong/pyproject.toml [tool.qpriv.overrides]" in err and named in err


def test_a_table_that_does_not_end_the_file_is_refused(tmp_path):
    app = make_app(tmp_path, "middle", "", rest=f'{A.HEADER}\n"paradigm" = "usl"\n\n[tool.other]\nkey = 1\n')
    with pytest.raises(A.AppError, match="must end the file"):
        A.written(app)
