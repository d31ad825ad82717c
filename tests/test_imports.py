"""The package's imports, read from the source (nothing is imported): no cycle, no upward import,
and no import inside a function without the reason written beside it.

Data flows one way: sources and training feed policy and the loop, policy is pure, effects and
telemetry act on what policy decided, and presentation (the commands, the demo, the wiring that
builds every part) sits at the edge. The layer table below is that rule as data: a module may
import its own group and any group of a lower rank, never a sibling group of the same rank (sources
never call policy) and never a higher one. A cycle is a cycle wherever the import sits, so imports
inside functions count for both checks; an import under ``if TYPE_CHECKING:`` never runs, so it
makes no cycle, but it still points one way and counts for the layer order.

An import inside a function carries its reason on the same line or in the comment just above it
(or above the run of imports it opens), marked ``# deferred: <why>``: a heavy or optional
dependency only one command loads, a library that must not load before the process is set up.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import healthagent

PACKAGE_DIR = Path(healthagent.__file__).parent
REASON_MARKER = "# deferred:"

# (group, rank, module prefixes). Longest matching prefix wins; a module matching none fails.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    # Shared values and tables every layer may read. ``telemetry.spec`` is the one table of metric
    # names and help texts: the exporter and the training intake render from it.
    ("foundation", 0, ("healthagent", "healthagent.common", "healthagent.clock",
                       "healthagent.bounded_names", "healthagent.kube_syntax", "healthagent.config",
                       "healthagent.model", "healthagent.model_adapter", "healthagent.model_fabric",
                       "healthagent.stage_history", "healthagent.telemetry.spec")),
    ("sources", 1, ("healthagent.sources",)),
    ("policy", 1, ("healthagent.policy",)),
    ("training", 1, ("healthagent.training",)),
    ("effects", 2, ("healthagent.effects", "healthagent.dra")),
    ("telemetry", 3, ("healthagent.telemetry",)),
    # The loop, and the budget counter: a program of its own (a Deployment) built on the effects.
    ("agent", 4, ("healthagent.agent", "healthagent.budget_counter")),
    ("presentation", 5, ("healthagent.wiring", "healthagent.cli", "healthagent.cli_inputs",
                         "healthagent.cli_token", "healthagent.check_report", "healthagent.__main__",
                         "healthagent.demo", "healthagent.present")),
)

# Known exceptions, each with the reason it stands: (importer, imported) -> why.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    type_only: bool


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _known(name: str) -> str:
    while name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [_known(a.name) for a in node.names if a.name.split(".")[0] == "healthagent"]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    if base.split(".")[0] != "healthagent":
        return []
    return [_known(f"{base}.{a.name}") if f"{base}.{a.name}" in MODULES else _known(base)
            for a in node.names]


def _function_imports(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _type_only_imports(tree: ast.Module) -> set[int]:
    """Imports under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): read by type checkers only."""
    only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            only.update(id(n) for part in node.body for n in ast.walk(part)
                        if isinstance(n, (ast.Import, ast.ImportFrom)))
    return only


def _read() -> tuple[list[Edge], list[str]]:
    """Every package-internal import edge, and each function-level import lacking its reason."""
    edges: list[Edge] = []
    unexplained: list[str] = []
    for module, (path, is_package) in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        inside = _function_imports(tree)
        type_only = _type_only_imports(tree)
        import_lines = {ln for n in ast.walk(tree) if id(n) in inside
                        for ln in range(n.lineno, n.end_lineno + 1)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            in_function = id(node) in inside
            edges += [Edge(module, t, node.lineno, in_function, id(node) in type_only)
                      for t in _targets(module, is_package, node) if t != module]
            if in_function and not _has_reason(lines, node, import_lines):
                unexplained.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}: "
                                   f"{ast.unparse(node)}")
    return edges, unexplained


def _has_reason(lines: list[str], node: ast.stmt, import_lines: set[int]) -> bool:
    if any(REASON_MARKER in lines[ln - 1] for ln in range(node.lineno, node.end_lineno + 1)):
        return True
    above = node.lineno - 1
    while above in import_lines:  # the reason above a run of imports covers the run
        above -= 1
    while above >= 1 and lines[above - 1].strip().startswith("#"):
        if lines[above - 1].strip().startswith(REASON_MARKER):
            return len(lines[above - 1].strip()) > len(REASON_MARKER) + 3
        above -= 1
    return False


def _layer(module: str) -> tuple[str, int]:
    best = max(((prefix, group, rank) for group, rank, prefixes in LAYERS for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")),
               key=lambda hit: len(hit[0]), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1], best[2]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if start not in colour and (found := visit(start)):
            return found
    return None


EDGES, UNEXPLAINED = _read()


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for edge in EDGES:
        if not edge.type_only:
            graph.setdefault(edge.source, set()).add(edge.target)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _against_layers(edges: list[Edge]) -> list[str]:
    wrong = []
    for edge in edges:
        (group, rank), (target_group, target_rank) = _layer(edge.source), _layer(edge.target)
        if group == target_group or target_rank < rank:
            continue
        if (edge.source, edge.target) in ALLOWED_UPWARD:
            continue
        wrong.append(f"{edge.source}:{edge.line} ({group}) imports {edge.target} ({target_group})")
    return sorted(set(wrong))


def test_no_upward_import():
    wrong = _against_layers(EDGES)
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_function_level_imports_carry_their_reason():
    assert not UNEXPLAINED, (f"imports inside a function need '{REASON_MARKER} <why>' beside them:\n"
                             + "\n".join(sorted(set(UNEXPLAINED))))


def test_the_checks_see_a_cycle_a_missing_reason_and_a_type_only_import():
    """The readers themselves: a two-module cycle is found, a bare function import is flagged, an
    import under ``if TYPE_CHECKING:`` is known as type-only, and an upward pair names its layers."""
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\n"
              "def f():\n    import os\n\ndef g():\n    # deferred: loads only here\n    import os\n")
    tree = ast.parse(source)
    inside = _function_imports(tree)
    imports = sorted((n for n in ast.walk(tree) if id(n) in inside), key=lambda n: n.lineno)
    import_lines = {n.lineno for n in imports}
    assert [_has_reason(source.splitlines(), n, import_lines) for n in imports] == [False, True]
    assert len(_type_only_imports(tree)) == 1
    assert _layer("healthagent.policy.classify") == ("policy", 1)
    assert _layer("healthagent.telemetry.spec") == ("foundation", 0)
    assert _against_layers([Edge("healthagent.sources.efa", "healthagent.policy.findings", 1, False, False),
                            Edge("healthagent.effects.kube", "healthagent.policy.findings", 1, False, False),
                            Edge("healthagent.model", "healthagent.wiring", 1, True, False)]) == [
        "healthagent.model:1 (foundation) imports healthagent.wiring (presentation)",
        "healthagent.sources.efa:1 (sources) imports healthagent.policy.findings (policy)"]
