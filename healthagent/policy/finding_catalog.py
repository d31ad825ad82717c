"""The finding catalog: one row per finding code, read from ``findings.csv``.

Why one row: a code is a contract (alerts, dashboards, runbook anchors, the node condition's reason,
an engine's repair rules all key on it), and everything the agent says or decides about a code
that is not the rule's own judgement is data: what it means, which node condition it turns, its
default action, when it may open (the debounce defaults), which thresholds its rule reads, its
reason in each engine's vocabulary, its runbook. Those facts live in ``findings.csv`` beside
``xid_catalog.csv``; ``findings.FINDINGS``, ``debounce.BUILT_IN``, ``conditions.EKS_REASONS``,
``hyperpod.fault_type_of``, ``healthagent explain CODE`` and ``docs/reference/findings.md`` are views
of it. Adding a finding is its rule (which declares the code in its module's ``PRODUCES``), one row
here and its test; a test fails when a row has no rule or a rule's code has no row.

Columns:

- ``code``, ``title`` (a few words), ``condition`` (``gpu`` or ``network``: the node condition it
  turns), ``action`` (empty: decided per event by a catalog, the XID or the mlx5 one);
- ``reads`` (how its signal arrives: ``events``, ``gpu``, ``efa``, ``rdma``, ``pcie``, ``inventory``),
  ``kind`` (``condition``: a state read every time; ``event``);
- ``count``, ``window``, ``sustain``, ``after_boot_grace``: the built-in debounce rule (seconds;
  an empty window: ``count`` readings in a row), as ``debounce.py`` describes;
- ``thresholds``: the ``thresholds:`` keys of the policy file its rule reads (space-separated), each
  a row of ``thresholds.csv`` (its default, kind and source; ``threshold_catalog.py``);
- ``eks_reason``, ``eks_reason_from`` (``nma``: the EKS node monitoring agent's name; ``coined``);
- ``hyperpod_fault_type``: the value of SageMaker HyperPod's ``fault-types`` label;
- ``runbook`` (the docs anchor), ``next_steps`` (a template: ``{gpu}``, ``{index}``, ``{device}``).

This module reads the CSV and nothing else of the agent (every other policy module may import it).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Mapping

CATALOG_FILE = "findings.csv"
COLUMNS = ("code", "title", "condition", "action", "reads", "kind", "count", "window", "sustain",
           "after_boot_grace", "thresholds", "eks_reason", "eks_reason_from", "hyperpod_fault_type",
           "runbook", "next_steps")
CONDITIONS = ("gpu", "network")
READS = ("events", "gpu", "efa", "rdma", "pcie", "inventory")
KINDS = ("condition", "event")
REASON_FROM = ("nma", "coined")


class CatalogError(ValueError):
    """A malformed row of the bundled catalog: a packaging bug, raised at import."""


@dataclass(frozen=True)
class CatalogRow:
    """One finding code as the catalog states it (the module docstring names the columns)."""

    code: str
    title: str
    condition: str
    action: str  # an Action value, or "" (decided per event by a catalog)
    reads: str
    kind: str
    count: int
    window: float | None
    sustain: float
    after_boot_grace: float
    thresholds: tuple[str, ...]
    eks_reason: str
    eks_reason_from: str
    hyperpod_fault_type: str
    runbook: str
    next_steps: str


def _seconds(row: dict[str, str], column: str, empty: float | None) -> float | None:
    text = row[column].strip()
    if not text:
        return empty
    value = float(text)
    if not 0 <= value < float("inf"):
        raise CatalogError(f"{CATALOG_FILE}: {row['code']}: {column} {text!r} is not a duration")
    return value


def _one_of(row: dict[str, str], column: str, allowed: tuple[str, ...]) -> str:
    value = row[column].strip()
    if value not in allowed:
        raise CatalogError(f"{CATALOG_FILE}: {row['code']}: {column} {value!r} is not one of {', '.join(allowed)}")
    return value


def parse_catalog(text: str) -> tuple[CatalogRow, ...]:
    """The rows of a catalog document, in order; raises CatalogError on a malformed one."""
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise CatalogError(f"{CATALOG_FILE}: the columns must be {', '.join(COLUMNS)}")
    rows: list[CatalogRow] = []
    for raw in reader:
        code = raw["code"].strip()
        if any(r.code == code for r in rows):
            raise CatalogError(f"{CATALOG_FILE}: {code} has two rows")
        count = int(raw["count"] or 1)
        if count < 1:
            raise CatalogError(f"{CATALOG_FILE}: {code}: count must be at least 1")
        rows.append(CatalogRow(
            code=code, title=raw["title"].strip(), condition=_one_of(raw, "condition", CONDITIONS),
            action=raw["action"].strip(), reads=_one_of(raw, "reads", READS), kind=_one_of(raw, "kind", KINDS),
            count=count, window=_seconds(raw, "window", None), sustain=_seconds(raw, "sustain", 0.0) or 0.0,
            after_boot_grace=_seconds(raw, "after_boot_grace", 0.0) or 0.0,
            thresholds=tuple(raw["thresholds"].split()), eks_reason=raw["eks_reason"].strip(),
            eks_reason_from=_one_of(raw, "eks_reason_from", REASON_FROM),
            hyperpod_fault_type=raw["hyperpod_fault_type"].strip(), runbook=raw["runbook"].strip(),
            next_steps=raw["next_steps"].strip()))
    return tuple(rows)


@lru_cache(maxsize=1)
def catalog_rows() -> tuple[CatalogRow, ...]:
    """The bundled catalog (read once)."""
    return parse_catalog(resources.files("healthagent.policy").joinpath(CATALOG_FILE).read_text("utf-8"))


def catalog() -> Mapping[str, CatalogRow]:
    """Code -> its row, in the catalog's order."""
    return MappingProxyType({row.code: row for row in catalog_rows()})
