"""Every package folder past eight modules has a README.md with one line per module.

A newcomer opening ``healthagent/effects/`` finds two dozen files; the folder's README says in one
line what each is for. This keeps that index true: a module added without its line, or a line left
behind for a module that moved, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "healthagent"
MOST_WITHOUT_INDEX = 8


def _crowded_folders() -> list[Path]:
    folders = [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]
    return sorted(f for f in folders if len(_modules(f)) > MOST_WITHOUT_INDEX)


def _modules(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}


def test_some_folder_is_crowded_enough_to_need_an_index():
    assert PACKAGE in _crowded_folders()


@pytest.mark.parametrize("folder", _crowded_folders(), ids=lambda f: str(f.relative_to(PACKAGE.parent)))
def test_the_folder_readme_has_one_line_per_module(folder: Path):
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder.relative_to(PACKAGE.parent)} has more than {MOST_WITHOUT_INDEX} modules and no README.md"
    listed = re.findall(r"^- `([^`]+\.py)`: \S", readme.read_text(encoding="utf-8"), flags=re.M)
    assert len(listed) == len(set(listed)), f"{readme}: a module is listed twice"
    assert set(listed) == _modules(folder), (
        f"{readme}: missing {sorted(_modules(folder) - set(listed))}, stale {sorted(set(listed) - _modules(folder))}")
