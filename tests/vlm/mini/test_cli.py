"""`qpriv-mini`: a build whose own check fails ends with its message, not a traceback."""

import pytest

from vlm.mini import cli
from vlm.mini.build import MiniBuildFailed


def test_a_failed_build_exits_with_its_message(monkeypatch, capsys, tmp_path):
    def fail(*_, **__):
        raise MiniBuildFailed("the base stage did not learn to compare (seeds 0..2)")

    monkeypatch.setattr(cli, "build_mini", fail)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--cache-dir", str(tmp_path), "build"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "qpriv-mini: the base stage did not learn to compare (seeds 0..2)\n"
