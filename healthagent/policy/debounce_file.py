"""The policy file's ``findings:`` section: per-code rules over the built-in table, validated whole.

::

    findings:
      GPU_NVLINK_ERRORS: {count: 3, window: 10m, after_boot_grace: 15m}
      GPU_THERMAL_THROTTLE: {sustain: 10m}

Durations are seconds as a number, or a number with ``s``, ``m`` or ``h`` (``90s``, ``10m``,
``1h``). The effective rule of a code is the built-in row (``debounce.BUILT_IN``), then the old
threshold keys that stand for a rule field (``condition_raise_evaluations``,
``throttle_sustain_seconds``: existing files keep working), then the code's own entry; each field
remembers where it came from, for ``healthagent explain CODE``.

A rule that can never be met is refused, not run: a count the window cannot hold at the sources'
reading interval (the finding would be silently off), a duration on a signal that has none (an
XID is logged at one moment), a count "in a row" of a signal that is never read in between.
Each mistake is one ``PolicyError`` line naming the key and the fix, like the rest of the file.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping

from healthagent.policy.debounce import (ALIASES, EVENTS, FIELDS, INVENTORY, MAX_HITS, READING_WORDS, EFA,
                                         GPU, PCIE, RDMA, Rule, row)
from healthagent.policy.findings import DOCS, FINDING_CODES, duration_words
from healthagent.policy.policy_error import PolicyError
from healthagent.policy.policy_error import shown_key as _shown
from healthagent.policy.policy_error import written_value as _written

BUILT_IN_ORIGIN = "built-in"
MAX_DURATION = 30 * 24 * 3600.0  # as the thresholds' seconds: far past any real use
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smh]?)\s*", re.IGNORECASE)
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_EXAMPLE = {"count": "3", "window": "10m", "sustain": "5m", "after_boot_grace": "15m"}


@dataclass(frozen=True)
class Rules:
    """The effective rule of every finding code, and where each field that is not the built-in
    one came from (``thresholds.<key>`` or ``findings.<CODE>.<field>``)."""

    by_code: Mapping[str, Rule]
    origins: Mapping[str, Mapping[str, str]]
    counting: frozenset[str] = frozenset()  # the codes whose rule is not "at once" (``counts``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counting", frozenset(c for c, r in self.by_code.items() if not r.at_once))

    def rule(self, code: str) -> Rule:
        rule = self.by_code.get(code)
        return rule if rule is not None else row(code).rule

    def counts(self, code: str) -> bool:
        """The code's rule remembers readings (a count or a sustain): only then does a reading
        without the signal matter, and only then do the rules report one (32 EFA ports x 7
        counters a collection would otherwise be that many signals nobody reads)."""
        return code in self.counting

    def origin(self, code: str, name: str) -> str:
        return self.origins.get(code, {}).get(name, BUILT_IN_ORIGIN)


def built_in_rules() -> Rules:
    return Rules(MappingProxyType({code: row(code).rule for code in FINDING_CODES}), MappingProxyType({}))


def reading_intervals(settings: Any) -> dict[str, float]:
    """Seconds between the readings that feed each kind of code, from the agent's settings: NVML
    is the GPU source when it is on (dcgm-exporter only fills in without it), the inventory is
    counted on every new set of GPU or EFA samples."""
    gpu = settings.nvml_interval_seconds if settings.nvml or not settings.dcgm_url else settings.dcgm_interval_seconds
    return {GPU: float(gpu), EFA: float(settings.efa_interval_seconds), RDMA: float(settings.rdma_interval_seconds),
            PCIE: float(settings.rdma_interval_seconds),  # the AER files are read on the RDMA ports' schedule
            INVENTORY: float(min(gpu, settings.efa_interval_seconds))}


def parse_rules(raw: Any, aliases_given: Mapping[str, float],
                readings: Mapping[str, float] | None = None) -> Rules:
    """The ``findings:`` section over the table and the aliases set in ``thresholds:``. Raises
    ``PolicyError``. ``readings``: seconds between readings by kind (``reading_intervals``); None leaves the window-against-count check out (a
    command that judges no readings, such as ``classify``)."""
    by_code = {code: row(code).rule for code in FINDING_CODES}
    origins: dict[str, dict[str, str]] = {}
    for key, value in aliases_given.items():
        name, codes = ALIASES[key]
        for code in codes:
            if code in by_code:
                by_code[code] = replace(by_code[code], **{name: int(value) if name == "count" else float(value)})
                origins.setdefault(code, {})[name] = f"thresholds.{key}"
    for code, entry in _entries(raw).items():
        for name, value in entry.items():
            by_code[code] = replace(by_code[code], **{name: value})
            origins.setdefault(code, {})[name] = f"findings.{code}.{name}"
    for code, fields in origins.items():
        _check(code, by_code[code], fields, readings)
    return Rules(MappingProxyType(by_code), MappingProxyType({c: MappingProxyType(f) for c, f in origins.items()}))


def _error(text: str) -> Exception:
    return PolicyError(text)


def _entries(raw: Any) -> dict[str, dict[str, Any]]:
    """Each code's entry, validated field by field (codes in upper case, as ``disabled_rules``)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _error("findings: must be a mapping of finding code: rule, e.g. "
                     "{GPU_NVLINK_ERRORS: {count: 3, window: 10m}}")
    out: dict[str, dict[str, Any]] = {}
    written: dict[str, Any] = {}
    for key, entry in raw.items():
        code = str(key).strip().upper()
        if code not in FINDING_CODES:
            near = difflib.get_close_matches(code, FINDING_CODES, n=1)
            raise _error(f"findings.{_shown(key)}: unknown finding code; "
                         + (f"did you mean {near[0]}? " if near else "")
                         + f"use one from {DOCS}: " + ", ".join(FINDING_CODES))
        if code in written:
            raise _error(f"findings.{code}: {_written(written[code])} and {_written(key)} both name {code}; keep one")
        written[code] = key
        if not isinstance(entry, dict) or not entry:
            raise _error(f"findings.{code}: must be a mapping with " + ", ".join(FIELDS)
                         + ", e.g. {count: 3, window: 10m}")
        fields: dict[str, Any] = {}
        for name, value in entry.items():
            if name not in FIELDS:
                raise _error(f"findings.{code}.{_shown(name)}: unknown key; valid keys: " + ", ".join(FIELDS))
            fields[name] = _count(code, value) if name == "count" else _duration(f"findings.{code}.{name}", value,
                                                                                _EXAMPLE[name])
        out[code] = fields
    return out


def _count(code: str, raw: Any) -> int:
    where = f"findings.{code}.count"
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _error(f"{where}: {_written(raw)} is not a number; use a whole number of at least 1, e.g. 3")
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        raise _error(f"{where}: {_written(raw)} is not a number; use a whole number of at least 1, e.g. 3") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise _error(f"{where}: {_written(raw)} must be a whole number of at least 1 (1 opens at once), e.g. 3")
    if value > MAX_HITS:
        raise _error(f"{where}: {value:g} is out of range; use at most {MAX_HITS}")
    return int(value)


def _duration(where: str, raw: Any, example: str) -> float:
    """Seconds from a number or ``90s``/``10m``/``1h``; ``PolicyError`` naming ``where`` otherwise."""
    fix = f"use seconds (600) or a number with s, m or h (90s, 10m, 1h), e.g. {example}"
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _error(f"{where}: {_written(raw)} is not a duration; {fix}")
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("-") and _DURATION.fullmatch(text[1:]):
            raise _error(f"{where}: {_written(raw)} is negative; use 0 or more, e.g. {example}")
        match = _DURATION.fullmatch(text)
        if match is None:
            raise _error(f"{where}: {_written(raw)} is not a duration; {fix}")
        value = float(match.group(1)) * _UNIT[match.group(2).lower()]
    else:
        value = float(raw)
    if not math.isfinite(value):
        raise _error(f"{where}: {_written(raw)} is not a finite duration; {fix}")
    if value < 0:
        raise _error(f"{where}: {_written(raw)} is negative; use 0 or more, e.g. {example}")
    if value > MAX_DURATION:
        raise _error(f"{where}: {_written(raw)} is out of range; use at most {MAX_DURATION / 86400:g} days "
                     "(to turn the rule off use disabled_rules)")
    return value


def _check(code: str, rule: Rule, fields: Mapping[str, str], readings: Mapping[str, float] | None) -> None:
    """A rule whose fields can be met together; the error names the field the file set."""
    def key(*names: str) -> str:
        return next((fields[n] for n in names if n in fields), f"findings.{code}.{names[0]}")

    reads = row(code).reads
    if reads == EVENTS:
        if rule.sustain > 0:
            raise _error(f"{key('sustain')}: {code} is an event logged at one moment, it lasts no time; "
                         "use count and window instead, e.g. {count: 3, window: 10m}")
        if rule.count > 1 and not rule.window:
            raise _error(f"{key('window')}: count {rule.count} needs a window: {code} is an event with no "
                         "readings in between to count in a row; add e.g. window: 10m")
        return
    interval = (readings or {}).get(reads)
    if rule.count > 1 and rule.window is not None:
        if rule.window <= 0:
            raise _error(f"{key('window', 'count')}: a window of 0 s holds one reading, not {rule.count}; "
                         "use a longer window (e.g. 10m), or leave it out to count readings in a row")
        needed = (rule.count - 1) * interval if interval is not None else 0.0
        if rule.window < needed:
            raise _error(f"{key('window', 'count')}: {duration_words(rule.window)} cannot hold {rule.count} "
                         f"{READING_WORDS[reads]} (one every {interval:g} s, so {rule.count} take "
                         f"{needed:g} s); use a window of at least {needed:g}s or a smaller count")

