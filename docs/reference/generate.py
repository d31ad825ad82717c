"""Write every generated reference page of docs/reference/ from its source of truth.

    python docs/reference/generate.py          # rewrite the pages
    python docs/reference/generate.py --check  # exit 1 naming each stale page

Generated, not written by hand: a copy of a table drifts from the table. Each page is rendered
from what the code and the rule files declare (the metric table, the Settings dataclass and the
argparse parser, the policy thresholds, the finding catalog, the rule files), deterministically,
so tests/test_references_current.py renders them and compares them with the committed files.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the page modules are siblings of this script, not a package
    sys.path.insert(0, str(HERE))

PAGES = ("generate_findings", "metrics_page", "alerts_page", "settings_page")


def renderers() -> dict[Path, Callable[[], str]]:
    """Each page's file and the function that renders it."""
    out = {}
    for name in PAGES:
        module = importlib.import_module(name)
        out[module.TARGET] = module.render
    return out


def stale() -> list[Path]:
    """The pages whose committed text differs from what the sources give now."""
    return [path for path, render in renderers().items()
            if not path.exists() or path.read_text(encoding="utf-8") != render()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed page is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"{path.relative_to(HERE.parents[1])} is stale: run python docs/reference/generate.py",
                  file=sys.stderr)
        return 1 if old else 0
    for path, render in renderers().items():
        path.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
