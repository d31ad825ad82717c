"""Kubernetes ``Time`` as the API server reads and writes it: RFC 3339 in UTC, second precision.

Only wall time goes through here: what people and the API read (a taint's ``timeAdded``, a
condition's transition time). Durations are measured on the decision clock (``healthagent/clock.py``).
"""

from __future__ import annotations

from datetime import datetime, timezone


def rfc3339(ts: float) -> str:
    """Kubernetes ``Time``: RFC 3339 in UTC at second precision."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
