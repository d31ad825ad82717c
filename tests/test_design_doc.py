"""docs/design.md's module map names every module of the package, and nothing that is not there.

The map is where a reader learns what each file is for; a module added without its line, or a
line left for a module that moved, makes the map lie. Paths are written relative to
``healthagent/`` in backticks (``effects/kube.py``). Any such path the page names elsewhere must
exist too, under ``healthagent/`` or from the repository root (``deploy/generate.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "healthagent"
DOC = REPO / "docs" / "design.md"
MAP_HEADING = "## Module map"
OPTIONAL = {"__main__.py"}  # the entry point: named or not, as the page reads best

BULLET = re.compile(r"^- `([\w/.]+\.(?:py|csv))`: \S", re.MULTILINE)
NAMED = re.compile(r"`([\w./-]+\.(?:py|csv))`")


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _module_map() -> list[str]:
    text = _text()
    assert MAP_HEADING in text, f"docs/design.md has no '{MAP_HEADING}' section"
    section = text.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    return BULLET.findall(section)


def _package_files() -> set[str]:
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    data = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.csv")}
    return modules | data


def test_the_map_names_every_module_and_data_file_once():
    listed = _module_map()
    assert len(listed) == len(set(listed)), sorted({m for m in listed if listed.count(m) > 1})
    missing = _package_files() - set(listed) - OPTIONAL
    assert not missing, f"docs/design.md's module map lacks {sorted(missing)}"


def test_the_map_names_nothing_that_is_not_there():
    stale = set(_module_map()) - _package_files()
    assert not stale, f"docs/design.md's module map names {sorted(stale)}, which healthagent/ does not hold"


def test_every_file_the_page_names_exists():
    named = set(NAMED.findall(_text()))
    assert named, "the page names no file"
    missing = sorted(n for n in named if not (PACKAGE / n).is_file() and not (REPO / n).is_file())
    assert not missing, f"docs/design.md names {missing}, found neither under healthagent/ nor from the root"


def test_a_missing_module_would_be_caught():
    """The map check fails on a package with one module more: it can fail."""
    listed = set(_module_map())
    assert "effects/kube.py" in listed
    assert ("sources/made_up.py" not in listed) and not (PACKAGE / "sources" / "made_up.py").exists()
    assert (_package_files() | {"sources/made_up.py"}) - listed - OPTIONAL == {"sources/made_up.py"}
