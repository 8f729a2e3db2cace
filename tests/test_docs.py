"""The manual and the method reference: README.md stays a short manual whose links stay inside the
repository, the docs/ pages build with `mkdocs build --strict`, and every registered method has
its row in the page that documents it, so a method added without docs fails here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from attacks import available_attacks
from privacy import defense_names
from pruning import policy_names

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LINES = 250
# [text](target) and ![alt](target); a target may carry a title after a space.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
# A path written out that climbs out of the file's folder, linked or not (`../shared/SPEC.md`).
CLIMB = re.compile(r"(?<![\w/.])((?:\.\./)+[\w.-][\w./-]*)")
# Sweeps that feed no results/*.md of their own: the memorisation preset is read by
# benchmarks/testbed_memorisation.py, the smoke sweep by the tests, pruning-mia by pruning-attacks'
# claims (membership through each policy), memorisation-audit by federated-privacy's report.
NOT_RESULTS_SWEEPS = {"memorisation", "smoke", "pruning-mia", "memorisation-audit"}


def test_the_docs_build_strictly_without_a_warning(tmp_path):
    """mkdocs' strict mode fails on any warning: a page missing from the nav or a nav entry
    without its page, a link between pages to a missing page or anchor."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr, built.stderr


@pytest.mark.parametrize(("page", "names"), [
    ("defenses.md", defense_names()), ("attacks.md", available_attacks()), ("pruning.md", policy_names())],
    ids=["defenses", "attacks", "pruning policies"])
def test_every_registered_method_has_its_row_in_the_docs(page, names):
    text = (DOCS / page).read_text()
    missing = [name for name in names if not re.search(rf"^\| `{re.escape(name)}` \|", text, re.MULTILINE)]
    assert not missing, f"docs/{page} has no table row for {missing}"


def test_the_readme_is_a_manual_of_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; the method reference belongs in docs/"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs write it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(match) for match in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_link_leaves_the_repository(page):
    """Every link is relative and lands on a file of the repository (and on a heading of it,
    where it names one); no address of another site, no path that climbs out of the repository."""
    text = page.read_text()
    outside = URL.findall(text)
    assert not outside, f"{page.name} links outside the repository: {outside}"
    problems = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    for path in CLIMB.findall(text):
        if not (page.parent / path).resolve().is_relative_to(ROOT.resolve()):
            problems.append(f"{path}: outside the repository")
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_make_sweeps_runs_every_results_sweep():
    """`make sweeps` runs each sweep benchmarks/sweep_results.py renders, and every shipped sweep
    file is one of them or one that feeds something else."""
    makefile = re.search(r"^SWEEPS = (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    rendered = re.search(r"^SWEEPS = \(([^)]*)\)", (ROOT / "benchmarks" / "sweep_results.py").read_text(), re.MULTILINE)
    assert makefile and rendered
    make_sweeps = makefile.group(1).split()
    assert make_sweeps == re.findall(r'"([^"]+)"', rendered.group(1))
    shipped = {path.stem for path in (ROOT / "sims" / "sweeps").glob("*.toml")}
    assert shipped - NOT_RESULTS_SWEEPS == set(make_sweeps)
