"""What the effects know that the node cannot tell: a frozen value, saved under the ``effects`` key.

Kept: that the agent's taint was confirmed applied (so a taint that later vanishes was removed by
hand, not never written) and when its grace started (on the decision clock, ``clock.py``), a
taint-removed clear not yet written to the node, the budget episode, the most severe action an
Event reported per finding (so an escalation is reported once), and the node object's uid. What
an operator's clear closes is policy's (the classifier keeps the last token); the node keeps the
clear-handled annotation. Everything is re-checked against the node on every step; the node wins where both know.

``EffectsState`` is a value: the pure ``effects/step.py`` returns a new one and the driver
(``effects/kube.py``) keeps whichever the API server confirmed. The Event ledger and the
dry-run node are the driver's and are saved beside it (``to_state(extra)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from healthagent.effects.other_writers import OtherWriter

STATE_KEY = "effects"
RECORD_VERSION = 2
MAX_REPORTED = 1024  # as many findings as the Event ledger remembers delivered keys


@dataclass(frozen=True)
class AppliedTaint:
    """The agent's taint as confirmed by a successful write (or adopted from the node)."""

    value: str  # reboot_node | replace_node
    effect: str  # NoSchedule | NoExecute
    since: float  # when the taint with this value was applied (decision clock): the grace starts here
    code: str = ""  # the code of the most severe finding when it was applied

    @classmethod
    def from_dict(cls, data: Any) -> "AppliedTaint | None":
        try:
            return cls(value=str(data["value"]), effect=str(data["effect"]), since=float(data["since"]),
                       code=str(data.get("code", "")))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class EffectsState:
    """What the agent wrote and what it learnt from the node, as one value."""

    node_uid: str = ""
    taint: AppliedTaint | None = None
    # The agent's taint was removed by hand: the clear token to write as the clear annotation
    # (until it is on the node, the plan holds and writes it).
    clear_to_write: str = ""
    budget_blocked: bool = False  # held at NoSchedule by the budget right now
    budget_blocked_total: int = 0  # times held (cumulative)
    boot_id: str = ""
    # finding key -> the most severe action an Event reported for it (oldest first, bounded)
    reported: tuple[tuple[str, str], ...] = ()
    # Not saved: what this run learnt. Other writers of the agent's conditions (``other_writers.py``),
    # and a slot reclaimed before the node's taint landed (the node goes back to held NoSchedule).
    foreign: tuple[OtherWriter, ...] = field(default=(), compare=False)
    rollback: bool = False
    # A write that removes the agent's taint went out unanswered (a timeout, a 504): it may have
    # landed, so the taint gone at the next read is the agent's own removal, not an operator's.
    removing: bool = field(default=False, compare=False)

    def reported_action(self, key: str) -> str | None:
        return dict(self.reported).get(key)

    def with_reported(self, key: str, action: str) -> "EffectsState":
        """``key`` now reported at ``action``; the oldest findings are forgotten first past
        ``MAX_REPORTED``."""
        kept = tuple(item for item in self.reported if item[0] != key) + ((key, action),)
        return replace(self, reported=kept[-MAX_REPORTED:])

    @classmethod
    def from_state(cls, data: Any) -> "EffectsState":
        """Restore tolerantly: a field of the wrong type falls back to its default."""
        if not isinstance(data, dict):
            return cls()
        reported: dict[str, str] = {}
        for key, action in _typed(data.get("reported"), dict, {}).items():
            if isinstance(action, str):
                reported.pop(str(key), None)
                reported[str(key)] = action
        return cls(
            node_uid=_typed(data.get("node_uid"), str, ""),
            taint=AppliedTaint.from_dict(data.get("taint")) if data.get("taint") else None,
            clear_to_write=_typed(data.get("clear_to_write"), str, ""),
            budget_blocked=_typed(data.get("budget_blocked"), bool, False),
            budget_blocked_total=_typed(data.get("budget_blocked_total"), int, 0),
            boot_id=_typed(data.get("boot_id"), str, ""),
            reported=tuple(reported.items())[-MAX_REPORTED:],
        )

    def to_state(self, extra: dict | None = None) -> dict:
        """The saved form, with the driver's parts (``extra``: the ledger, the dry-run node)."""
        data = {
            "version": RECORD_VERSION, "node_uid": self.node_uid,
            "taint": None if self.taint is None else {"value": self.taint.value, "effect": self.taint.effect,
                                                      "since": self.taint.since, "code": self.taint.code},
            "clear_to_write": self.clear_to_write,
            "budget_blocked": self.budget_blocked, "budget_blocked_total": self.budget_blocked_total,
            "boot_id": self.boot_id, "reported": dict(self.reported),
        }
        data.update(extra or {})
        return data


def saved_part(data: Any, key: str, kind: type, default: Any) -> Any:
    """One of the driver's parts of the saved record (``emitted``, ``outbox``, ``dry_run_node``)."""
    return _typed(data.get(key) if isinstance(data, dict) else None, kind, default)


def _typed(value: Any, kind: type, default: Any) -> Any:
    if kind is int and isinstance(value, bool):
        return default
    return value if isinstance(value, kind) else default
