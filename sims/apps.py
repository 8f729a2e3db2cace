"""Each Flower App's `[tool.flwr.app.config]`, written from the schema.

`flwr run --run-config` may only override keys the app declares, so every app declares every key
of config/schema.py. Each value is still declared once: its default in the schema, and an app's own
value in that app's `[tool.qpriv.overrides]` (with the comment that explains it), after those of
the app it names as `[tool.qpriv] base` (a folder relative to its own). This command writes the
table, which ends the file, from the two; the rest of the file stays as it is:

    qpriv-apps            # rewrite every app's table (sims/*/, benchmarks/*/)
    qpriv-apps --check    # change nothing; exit 1 naming each app whose table is not current

An override the schema refuses stops both, naming the file, the key and what is allowed (exit 2).
"""

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from config import ConfigError, SimConfig, load_config
from sims.launch import toml_value

ROOT = Path(__file__).parents[1]
HEADER = "[tool.flwr.app.config]"
MARKER = "# Written by `qpriv-apps` from config/schema.py's defaults and [tool.qpriv.overrides]: edit those and rerun it."


class AppError(ValueError):
    """An app whose table cannot be written; the message names the file and what to change."""


def app_folders() -> list[Path]:
    return sorted(path.parent for folder in ("sims", "benchmarks") for path in (ROOT / folder).glob("*/pyproject.toml"))


def overrides(app: Path) -> dict[str, Any]:
    """The app's own values: its base app's, then its `[tool.qpriv.overrides]`."""
    qpriv = tomllib.loads((app / "pyproject.toml").read_text()).get("tool", {}).get("qpriv", {})
    inherited = overrides((app / qpriv["base"]).resolve()) if "base" in qpriv else {}
    return {**inherited, **qpriv.get("overrides", {})}


def table(app: Path) -> str:
    """The generated table: every schema key, sorted, with the app's value or the default."""
    values = {**SimConfig().to_flat(), **overrides(app)}
    try:
        load_config(values)
    except ConfigError as error:
        raise AppError(f"{app / 'pyproject.toml'} [tool.qpriv.overrides]: {error}") from None
    return "\n".join([MARKER, HEADER, *(f"{json.dumps(key)} = {toml_value(values[key])}" for key in sorted(values))]) + "\n"


def written(app: Path) -> str:
    """The app's pyproject.toml with its generated table (marker, header and keys to the end) current;
    an app without one gets it appended."""
    lines = (app / "pyproject.toml").read_text().splitlines(keepends=True)
    if f"{HEADER}\n" not in lines:
        return f"{''.join(lines).rstrip()}\n\n{table(app)}"
    at = lines.index(f"{HEADER}\n")
    if any(line.startswith("[") for line in lines[at + 1:]):
        raise AppError(f"{app / 'pyproject.toml'}: {HEADER} must end the file (qpriv-apps rewrites it to the end)")
    start = at - 1 if at and lines[at - 1] == f"{MARKER}\n" else at
    return "".join(lines[:start]) + table(app)


def stale(apps: list[Path]) -> dict[Path, str]:
    """The apps whose pyproject.toml is not what qpriv-apps writes, with what it writes."""
    texts = {app: written(app) for app in apps}
    return {app: text for app, text in texts.items() if text != (app / "pyproject.toml").read_text()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qpriv-apps", description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any app's table is not current")
    args = parser.parse_args(argv)
    apps = app_folders()
    try:
        outdated = stale(apps)
        if args.check:
            for app in outdated:
                print(f"qpriv-apps: {app.relative_to(ROOT)}/pyproject.toml is not current: run qpriv-apps", file=sys.stderr)
            return 1 if outdated else 0
        for app, text in outdated.items():
            (app / "pyproject.toml").write_text(text)
            print(f"wrote {app.relative_to(ROOT)}/pyproject.toml")
    except AppError as error:
        print(f"qpriv-apps: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
