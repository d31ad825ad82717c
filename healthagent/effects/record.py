"""What the effects remember across restarts, under the state file's ``effects`` key.

Only what the node object cannot tell is kept here: that the agent's taint was confirmed applied
(so a taint that later vanishes was removed by hand, not never written), when its grace started,
which findings an operator cleared, the budget episode, the Event ledger with the most severe action
reported per finding (so an escalation is reported once), and the dry-run node.
Everything is re-checked against the node on every read; the node wins where both know.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATE_KEY = "effects"
RECORD_VERSION = 1
MAX_CLEARED = 256
MAX_REPORTED = 1024  # as many findings as the Event ledger remembers delivered keys


@dataclass
class AppliedTaint:
    """The agent's taint as confirmed by a successful write (or adopted from the node)."""

    value: str  # reboot_node | replace_node
    effect: str  # NoSchedule | NoExecute
    since: float  # when the taint with this value was applied: the grace starts here
    code: str = ""  # the code of the most severe finding when it was applied

    @classmethod
    def from_dict(cls, data: Any) -> "AppliedTaint | None":
        try:
            return cls(value=str(data["value"]), effect=str(data["effect"]), since=float(data["since"]),
                       code=str(data.get("code", "")))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class EffectsRecord:
    node_uid: str = ""
    taint: AppliedTaint | None = None
    cleared: list[str] = field(default_factory=list)  # finding keys an operator cleared
    clear_token: str = ""
    budget_blocked: bool = False
    budget_blocked_total: int = 0
    boot_id: str = ""
    emitted: dict[str, float] = field(default_factory=dict)
    outbox: list[dict] = field(default_factory=list)
    dry_run_node: dict | None = None
    # finding key -> the most severe action an Event reported for it (oldest first, bounded)
    reported: dict[str, str] = field(default_factory=dict)

    def note_reported(self, key: str, action: str) -> None:
        """Remember the action an Event now reports for ``key``; the oldest findings are
        forgotten first past ``MAX_REPORTED``."""
        self.reported.pop(key, None)
        self.reported[key] = action
        for old in list(self.reported)[: max(0, len(self.reported) - MAX_REPORTED)]:
            del self.reported[old]

    @classmethod
    def from_state(cls, data: Any) -> "EffectsRecord":
        """Restore tolerantly: a field of the wrong type falls back to its default."""
        if not isinstance(data, dict):
            return cls()
        record = cls()
        record.node_uid = _typed(data.get("node_uid"), str, "")
        record.taint = AppliedTaint.from_dict(data.get("taint")) if data.get("taint") else None
        record.cleared = [str(k) for k in _typed(data.get("cleared"), list, [])][-MAX_CLEARED:]
        record.clear_token = _typed(data.get("clear_token"), str, "")
        record.budget_blocked = _typed(data.get("budget_blocked"), bool, False)
        record.budget_blocked_total = _typed(data.get("budget_blocked_total"), int, 0)
        record.boot_id = _typed(data.get("boot_id"), str, "")
        record.emitted = _typed(data.get("emitted"), dict, {})
        record.outbox = _typed(data.get("outbox"), list, [])
        record.dry_run_node = _typed(data.get("dry_run_node"), dict, None)
        for key, action in _typed(data.get("reported"), dict, {}).items():
            if isinstance(action, str):
                record.note_reported(str(key), action)
        return record

    def to_state(self) -> dict:
        data = asdict(self)
        data["version"] = RECORD_VERSION
        data["cleared"] = self.cleared[-MAX_CLEARED:]
        return data


def _typed(value: Any, kind: type, default: Any) -> Any:
    if kind is int and isinstance(value, bool):
        return default
    return value if isinstance(value, kind) else default
