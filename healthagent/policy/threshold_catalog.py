"""The thresholds: every tunable number the rules read, with its default and where that default
comes from, read from ``thresholds.csv``.

Why data: a threshold is half of a finding's contract (the other half is its row in
``findings.csv``, whose ``thresholds`` column names the ones its rule reads), and the default's
source (DCGM, AWS, infiniband-diags, NVIDIA) is what an operator weighs before changing it. One
table keeps the value, its kind, its help line and its source together; the policy file's
``thresholds:`` section (``settings.py``) overrides the values, and ``docs/reference/findings.md``
is generated from both tables.

Columns: ``name``; ``default`` (empty: the value the finding table's rows give, for the two keys
that set a field of several rows' debounce rule, ``debounce.ALIASES``); ``kind`` (``seconds``,
``count``: a whole number of at least 1, ``number``: 0 or more, ``factor``: at least 1);
``above_zero`` (``yes``: 0 is refused, a window or a quiet period of 0 seconds means nothing);
``maximum`` (empty: the kind's own bound, ``settings.MAX_BY_KIND``); ``help``; ``source``.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Mapping

from healthagent.policy.debounce import ALIASES, alias_default
from healthagent.policy.finding_catalog import CatalogError

THRESHOLDS_FILE = "thresholds.csv"
COLUMNS = ("name", "default", "kind", "above_zero", "maximum", "help", "source")
KINDS = ("seconds", "count", "number", "factor")


@dataclass(frozen=True)
class Threshold:
    default: float
    kind: str  # "seconds" | "count" (integer >= 1) | "number" (>= 0) | "factor" (>= 1)
    help: str
    source: str = ""
    above_zero: bool = False
    maximum: float | None = None  # None: the kind's bound


def _number(name: str, column: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CatalogError(f"{THRESHOLDS_FILE}: {name}: {column} {text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise CatalogError(f"{THRESHOLDS_FILE}: {name}: {column} {text!r} is not a number of 0 or more")
    return value


def parse_thresholds(text: str) -> Mapping[str, Threshold]:
    """Name -> Threshold, in the file's order; raises CatalogError on a malformed row."""
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise CatalogError(f"{THRESHOLDS_FILE}: the columns must be {', '.join(COLUMNS)}")
    out: dict[str, Threshold] = {}
    for raw in reader:
        name = raw["name"].strip()
        if name in out:
            raise CatalogError(f"{THRESHOLDS_FILE}: {name} has two rows")
        kind = raw["kind"].strip()
        if kind not in KINDS:
            raise CatalogError(f"{THRESHOLDS_FILE}: {name}: kind {kind!r} is not one of {', '.join(KINDS)}")
        text = raw["default"].strip()
        if not text and name not in ALIASES:
            raise CatalogError(f"{THRESHOLDS_FILE}: {name}: a default is needed (only "
                               f"{', '.join(ALIASES)} take theirs from findings.csv)")
        default = _number(name, "default", text) if text else alias_default(name)
        maximum = raw["maximum"].strip()
        out[name] = Threshold(default=default, kind=kind, help=raw["help"].strip(), source=raw["source"].strip(),
                              above_zero=raw["above_zero"].strip() == "yes",
                              maximum=_number(name, "maximum", maximum) if maximum else None)
    return MappingProxyType(out)


THRESHOLDS: Mapping[str, Threshold] = parse_thresholds(
    resources.files("healthagent.policy").joinpath(THRESHOLDS_FILE).read_text("utf-8"))
