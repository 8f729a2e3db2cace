"""The house's layers: no package imports one above it, and no modules import each other in a loop.

The order (bottom to top) is the layout table of docs/contributing.md. Imports are read from the source
with `ast`, including those inside functions and under TYPE_CHECKING: a lazy import still
ties the lower package to the higher one.
"""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Bottom to top; packages on one floor may import each other's modules but not a higher floor's.
LAYERS = (
    ("registry",),
    ("vqa", "vlm", "wire"),
    ("pruning", "privacy"),
    ("config",),
    ("training",),
    ("attacks",),
    ("clients", "strategies"),
    ("sims", "analysis"),
)
FLOOR = {package: floor for floor, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            # `from package import module` imports that module.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in FLOOR:
        for path in (ROOT / package).rglob("*.py"):
            modules[module_name(path)] = path
    return modules


MODULES = project_modules()


def test_every_package_is_on_a_floor():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages - set(FLOOR) == set(), "a new package needs its place in LAYERS (and the layout table of docs/contributing.md)"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_from_a_higher_floor(name):
    floor = FLOOR[name.split(".")[0]]
    upward = sorted(
        imported for imported in imported_modules(MODULES[name])
        if imported.split(".")[0] in FLOOR and FLOOR[imported.split(".")[0]] > floor
    )
    assert upward == [], f"{name} (floor {floor}) imports from higher floors: {upward}"


def test_no_import_cycles():
    graph = defaultdict(set)
    for name, path in MODULES.items():
        graph[name] = {imported for imported in imported_modules(path) if imported in MODULES and imported != name}
    visiting, done, cycles = set(), set(), []

    def visit(node: str, trail: list[str]) -> None:
        visiting.add(node)
        for nxt in sorted(graph[node]):
            if nxt in visiting:
                cycles.append([*trail[trail.index(nxt):], nxt])
            elif nxt not in done:
                visit(nxt, [*trail, nxt])
        visiting.discard(node)
        done.add(node)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    # A package's __init__ re-exporting its own modules is no loop of logic.
    cycles = [c for c in cycles if not all(m.split(".")[0] == c[0].split(".")[0] for m in c)
              or not any(MODULES[m].name == "__init__.py" for m in c)]
    assert cycles == [], f"import cycles: {cycles}"
