"""Which verdict an operator's clear takes away: the one open when the operator cleared.

A clear (the ``healthagent.io/clear`` annotation, or the agent's taint removed by hand) is seen
by the node watch on its own thread, and applied by the effects in their next step. A slow API
server or a conflicting write can put seconds between the two, and the loop may hand over a new
verdict meanwhile. The clear must take away what was open when it arrived, not a fault found in
those seconds: so the verdict held when the watch saw it arrive is kept (``arrived``) and the
step works against it (``verdict_for``) until the clear is applied. The applied clear's token and
its cut-off (that verdict's observation) go to the loop, which hands them to policy: policy
closes only what was open then. The cut-off is saved with the token, so a restart between the
step and the loop's next cycle keeps it.
"""

from __future__ import annotations

import threading
from typing import Any

from healthagent.model import Verdict

STATE_KEY = "effects_clear"  # {"token", "as_of"}: the verdict the last clear acted on


class ClearCut:
    """The token of the last clear applied, its cut-off, and the verdict a pending one acts on."""

    def __init__(self, saved: Any, token: str) -> None:
        self.token, self.as_of = restore(saved, token)
        self._arrival: Verdict | None = None
        self._lock = threading.Lock()  # the watch thread notes an arrival; the effects step reads it

    def arrived(self, held: Verdict | None, pending: bool) -> None:
        """The watch saw the node change (any thread): a clear now pending acts on ``held``."""
        with self._lock:
            if self._arrival is None and pending:
                self._arrival = held

    def verdict_for(self, verdict: Verdict, pending: bool) -> Verdict:
        """The verdict a step works against: the one that held when a still pending clear
        arrived, else ``verdict``."""
        with self._lock:
            arrival = self._arrival
        return arrival if arrival is not None and pending else verdict

    def note(self, applied_token: str, verdict: Verdict | None) -> None:
        """A clear applied in this step (the record's token changed) names this step's verdict as
        its cut-off."""
        if applied_token != self.token:
            self.token = applied_token
            self.as_of = (verdict.observation or None) if verdict is not None else None
            with self._lock:
                self._arrival = None

    def settle(self, pending: bool) -> None:
        """After a step: no clear pending (none arrived, or the operator took it back) holds no
        verdict."""
        with self._lock:
            if not pending:
                self._arrival = None

    def to_state(self) -> dict:
        return {"token": self.token, "as_of": self.as_of}


def restore(saved: Any, token: str) -> tuple[str, int | None]:
    """(token, cut-off) as saved, when the save belongs to the record's token; else unknown."""
    if isinstance(saved, dict) and saved.get("token") == token:
        as_of = saved.get("as_of")
        if isinstance(as_of, int) and not isinstance(as_of, bool) and as_of > 0:
            return token, as_of
    return token, None
