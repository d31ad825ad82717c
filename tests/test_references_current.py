"""The generated reference pages of docs/reference/ are current, start by saying how they are made,
stay readable, and every link in them resolves.

Each page is rendered in memory from its source of truth (docs/reference/generate.py) and compared
with the committed file; a difference fails with the command that rewrites it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference"
COMMAND = "python docs/reference/generate.py"
LONGEST_LINE = 200
WRAPPED_PAGES = ("metrics.md", "alerts.md", "settings.md", "findings.md")


def _load(name: str) -> ModuleType:
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, REFERENCE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


GENERATE = _load("generate")
PAGES = GENERATE.renderers()


def test_every_page_of_the_folder_is_generated():
    assert {path.name for path in PAGES} == {path.name for path in REFERENCE.glob("*.md")}
    assert {"findings.md", "metrics.md", "alerts.md", "settings.md"} <= {path.name for path in PAGES}


@pytest.mark.parametrize("path", sorted(PAGES), ids=lambda p: p.name)
def test_the_committed_page_is_what_its_sources_give(path):
    committed = path.read_text(encoding="utf-8") if path.exists() else ""
    assert committed == PAGES[path](), f"docs/reference/{path.name} is stale: run {COMMAND}"


@pytest.mark.parametrize("path", sorted(PAGES), ids=lambda p: p.name)
def test_a_page_starts_with_the_line_that_says_it_is_generated_and_how(path):
    first = PAGES[path]().splitlines()[0]
    assert "Generated" in first and COMMAND in first, first


@pytest.mark.parametrize("name", WRAPPED_PAGES)
def test_no_line_is_too_long_to_read(name):
    long = [line for line in (REFERENCE / name).read_text(encoding="utf-8").splitlines() if len(line) > LONGEST_LINE]
    assert long == []


# -- links ---------------------------------------------------------------------------------------------

_INLINE = re.compile(r"\]\(([^)\s]+)\)")
_DEFINITION = re.compile(r"^\[[^\]]+\]:\s+(\S+)\s*$", re.M)
_USED_LABEL = re.compile(r"(?<![\]\\])\[([^\]\[]+)\](?![(\[:])")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)}


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return _INLINE.findall(text) + _DEFINITION.findall(text)


def _broken(page: Path, text: str) -> list[str]:
    broken = []
    for link in _links(text):
        if re.match(r"[a-z]+://", link):
            continue
        file, _, fragment = link.partition("#")
        target = (page.parent / file).resolve() if file else page
        if not target.is_file():
            broken.append(f"{link}: no file {target}")
        elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
            broken.append(f"{link}: no heading with anchor #{fragment} in {target.name}")
    return broken


@pytest.mark.parametrize("path", sorted(PAGES), ids=lambda p: p.name)
def test_every_link_of_a_page_resolves(path):
    assert _broken(path, path.read_text(encoding="utf-8")) == []


def test_every_short_link_label_a_page_uses_is_defined():
    """``[HealthagentGpuLost]`` renders as a link only with its definition on the page."""
    for path in PAGES:
        text = re.sub(r"```.*?```|`[^`\n]*`", "", path.read_text(encoding="utf-8"), flags=re.S)
        defined = set(re.findall(r"^\[([^\]]+)\]:", text, flags=re.M))
        used = {label for label in _USED_LABEL.findall(text) if re.fullmatch(r"[A-Za-z0-9_:]+", label)}
        assert used <= defined, (path.name, sorted(used - defined))


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor():
    page = REFERENCE / "metrics.md"
    text = "[a](alerts.md#no-such-alert) [b](nowhere.md) [c](alerts.md#healthagentgpulost)\n[d]: ../findings.md#nope\n"
    assert [line.split(":")[0] for line in _broken(page, text)] == [
        "alerts.md#no-such-alert", "nowhere.md", "../findings.md#nope"]


# -- the alerts page's routing -------------------------------------------------------------------------

def test_the_receivers_on_the_alerts_page_are_where_alertmanager_routes():
    """The page's walk of the route tree gives every amtool case of alerts/routes-tests.yaml (amtool
    itself checks those cases in tests/alerts/test_alertmanager.py)."""
    alerts_page = _load("alerts_page")
    cases = yaml.safe_load((REPO / "alerts" / "routes-tests.yaml").read_text(encoding="utf-8"))["cases"]
    assert cases
    for case in cases:
        labels = {k: str(v) for k, v in case["labels"].items()}
        assert alerts_page.receivers_for(labels) == case["receivers"], case["name"]
