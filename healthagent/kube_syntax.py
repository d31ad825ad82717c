"""Kubernetes' syntax for label/taint keys and label selectors, checked locally.

Why here and not by the API server: a taint key or a budget selector the API rejects would surface
only when the agent first needs to taint or count nodes, i.e. during a fault, as a 422 in a log.
Settings are checked at start-up instead (``config.py``), with one line that says what is wrong.
The rules are apimachinery's (``validation.IsQualifiedName``, ``IsValidLabelValue`` and
``labels.Parse``); each function returns None when the text is valid, else why it is not.
"""

from __future__ import annotations

import re

# A name part: 1-63 characters, alphanumeric at both ends, '-', '_', '.' inside.
_NAME = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
_REQUIREMENT = re.compile(
    r"(?P<bang>!)?\s*(?P<key>[^\s!=<>(),]+)\s*"
    r"(?:(?P<op>==|=|!=|<|>)\s*(?P<value>[^\s!=<>(),]*)"
    r"|(?<=\s)(?P<setop>in|notin)\s*\((?P<values>[^()]*)\))?"
)


def qualified_name_problem(key: str) -> str | None:
    """Why ``key`` is not a qualified name (``[prefix/]name``), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"prefix {prefix!r} is not a lower-case DNS subdomain"
    if not _NAME.fullmatch(name):
        return (f"name {name!r} must be 1-63 characters of letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit")
    return None


def label_value_problem(value: str) -> str | None:
    if not _LABEL_VALUE.fullmatch(value):
        return (f"value {value!r} must be at most 63 characters of letters, digits, '-', '_' or "
                "'.', starting and ending with a letter or digit")
    return None


def label_selector_problem(selector: str) -> str | None:
    """Why ``selector`` would not parse as a label selector, or None ("" selects everything)."""
    if not selector.strip():
        return None
    for requirement in _split_top_level(selector):
        problem = _requirement_problem(requirement.strip())
        if problem:
            return f"{requirement.strip()!r}: {problem}"
    return None


def _split_top_level(selector: str) -> list[str]:
    """Split at commas outside parentheses (``a in (x,y),b`` is two requirements)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(selector[start:i])
            start = i + 1
    parts.append(selector[start:])
    return parts


def _requirement_problem(text: str) -> str | None:
    if not text:
        return "empty requirement (a stray comma?)"
    match = _REQUIREMENT.fullmatch(text)
    if match is None:
        return "not key, !key, key=value, key!=value, key in (v1,v2), key notin (v1,v2), key>N or key<N"
    problem = qualified_name_problem(match["key"])
    if problem:
        return f"key {problem}"
    if match["bang"] and (match["op"] or match["setop"]):
        return "'!key' takes no operator"
    if match["op"] in ("<", ">"):
        return None if re.fullmatch(r"-?\d+", match["value"] or "") else "'<' and '>' need an integer"
    if match["op"]:
        return label_value_problem(match["value"])
    if match["setop"]:
        values = [v.strip() for v in match["values"].split(",")]
        if values == [""]:
            return f"'{match['setop']}' needs at least one value"
        return next((p for p in map(label_value_problem, values) if p), None)
    return None
