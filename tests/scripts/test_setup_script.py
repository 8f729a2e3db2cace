"""scripts/setup.sh keeps the torch a .venv already holds (a GPU machine's CUDA build) and installs
TORCH_SPEC only into a .venv without one. Run on a copy of the script in a folder of stand-ins: a
.venv whose python sees only a fake torch package that reports a CUDA build (or no torch at all),
a pip that records what it is asked and installs nothing, and an nginx on PATH so the script asks
apt for nothing: no network, and the real environment is never touched."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[2] / "scripts" / "setup.sh"
CUDA_TORCH = '__version__ = "2.13.0+cu128"\n\n\nclass version:\n    cuda = "12.8"\n'


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def checkout(tmp_path):
    """(run, pip log, the .venv's python): `run(torch_installed, **environment)` runs the copied script."""
    repo, log = tmp_path / "repo", tmp_path / "pip.log"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SETUP, repo / "scripts" / "setup.sh")
    (repo / "pyproject.toml").write_text("")
    bin_, site, tools = repo / ".venv" / "bin", tmp_path / "site", tmp_path / "tools"
    for folder in (bin_, site, tools):
        folder.mkdir(parents=True)
    # -S: the interpreter's own site-packages (this test's real torch) stay out of sight.
    executable(bin_ / "python", f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    executable(bin_ / "pip", f'#!/bin/sh\necho "$@" >> "{log}"\n')
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    executable(tools / "nginx", "#!/bin/sh\nexit 0\n")

    def run(torch_installed: bool, **environment: str) -> None:
        if torch_installed:
            (site / "torch").mkdir()
            (site / "torch" / "__init__.py").write_text(CUDA_TORCH)
        env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), **environment}
        subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], env=env, check=True, capture_output=True,
                       timeout=60)

    return run, log, bin_ / "python"


def pip_calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_an_installed_cuda_build_is_kept(checkout):
    run, log, python = checkout
    run(torch_installed=True, TORCH_SPEC="torch==2.13.0")
    assert pip_calls(log) == ["install --quiet -e .[dev]"]
    cuda = subprocess.run([str(python), "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert cuda == "12.8"


@pytest.mark.parametrize(("environment", "spec"),
                         [({}, "torch==2.13.0"), ({"TORCH_SPEC": "torch==2.12.1"}, "torch==2.12.1")])
def test_a_venv_without_torch_gets_torch_spec(checkout, environment, spec):
    run, log, _ = checkout
    run(torch_installed=False, **environment)
    assert pip_calls(log) == ["install --quiet --upgrade pip", f"install --quiet {spec}", "install --quiet -e .[dev]"]
