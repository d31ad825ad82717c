"""Regenerate every ``dashboards/*.dashboard.py`` into the ``*.json`` beside it.

    python -m dashboards.generate            # write the JSON files
    python -m dashboards.generate --check    # exit 1 and name the files whose JSON is stale

The output is deterministic (sorted keys, two-space indent, panel ids in layout order, no
timestamps), so the committed JSON can be diffed against a fresh generation: the test suite does
exactly that, and a dashboard source edited without regenerating fails it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DASHBOARD_DIR = Path(__file__).resolve().parent
SOURCE_SUFFIX = ".dashboard.py"


def sources(directory: Path = DASHBOARD_DIR) -> list[Path]:
    return sorted(directory.glob("*" + SOURCE_SUFFIX))


def json_path(source: Path) -> Path:
    return source.with_name(source.name[: -len(SOURCE_SUFFIX)] + ".json")


def render(source: Path) -> str:
    """The JSON text of one dashboard source (grafanalib's loader and encoder, sorted keys)."""
    from grafanalib._gen import DashboardEncoder, loader

    _ensure_importable(source)
    dashboard = loader(str(source))
    return json.dumps(dashboard.to_json_data(), sort_keys=True, indent=2, cls=DashboardEncoder) + "\n"


def _ensure_importable(source: Path) -> None:
    """Sources import ``dashboards.common``: make the repository root importable when run as a file."""
    root = str(source.resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)


def generate(directory: Path = DASHBOARD_DIR) -> dict[Path, str]:
    """Every dashboard's output path and JSON text, without writing anything."""
    return {json_path(source): render(source) for source in sources(directory)}


def stale(directory: Path = DASHBOARD_DIR) -> list[Path]:
    """Generated files whose committed text differs from a fresh generation (or that are missing)."""
    return [path for path, text in generate(directory).items()
            if not path.exists() or path.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale JSON; exit 1 if any")
    parser.add_argument("--dir", type=Path, default=DASHBOARD_DIR, help="dashboard directory")
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(args.dir)
        for path in outdated:
            sys.stderr.write(f"stale: {path} (run python -m dashboards.generate)\n")
        return 1 if outdated else 0
    for path, text in generate(args.dir).items():
        path.write_text(text, encoding="utf-8")
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
