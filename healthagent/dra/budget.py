"""A device NoExecute takes the node's disruption-budget slot: the same slot the node's own NoExecute takes.

Why: a device taint with effect NoExecute evicts the pods that use the GPU, and with them a rank
of an elastic job, exactly as the node's NoExecute does for that job; fifty nodes each evicting
one GPU's pods at once is fifty disruptions. So a device NoExecute is written only while this
node holds a slot of the budget, through the node driver's own state and guard
(``NodeEffects.device_exchange``, ``effects/device_slot.py``). Without a slot the rule stays
NoSchedule and the quarantine is *held by the budget* until a slot frees (the guard's timed looks
and its watch wake the effects, as for the node).

While a device NoExecute stands, the node shows it on its own Node in the annotation
``healthagent.io/device-noexecute`` (the devices' names): the budget's reclaim rule
(``effects/budget_reclaim.py``) reads it as the holder's disruptive step, so another node does not
take over a slot whose holder carries no taint of the agent's but has evicted a GPU's pods. The
node path keeps the slot meanwhile (``NodeEffects.device_slot``); once no device NoExecute is
left and the node carries no taint of the agent's, the slot goes back.
"""

from __future__ import annotations

import logging
from typing import Any

from healthagent.common import ErrorTally
from healthagent.effects.backend import ApiError
from healthagent.effects.budget_reclaim import DEVICE_NO_EXECUTE_ANNOTATION, evicts_a_device
from healthagent.effects.node_desired import annotations_of, owned_taints

log = logging.getLogger(__name__)


class DeviceBudget:
    """The node's slot for its device NoExecutes (see the module's docstring)."""

    def __init__(self, inner: Any, api: Any, taint_key: str, tally: ErrorTally) -> None:
        self.inner = inner
        self.api = api
        self.taint_key = taint_key
        self.tally = tally
        self.evicting: tuple[str, ...] = ()  # devices whose NoExecute stands (what the slot is held for)
        self._marked: tuple[str | None] | None = None  # the annotation as last written (None: not yet)
        if hasattr(inner, "device_slot"):
            inner.device_slot = self.holds_for_devices

    def holds_for_devices(self) -> bool:
        """Does a device NoExecute hold the node's slot? Until this run has marked the node once
        (an agent restart), the node's annotation says so: the slot is not given back meanwhile."""
        if self.evicting:
            return True
        node = self.inner.node
        return self._marked is None and node is not None and evicts_a_device(node)

    def _exchange(self, want: str, now: float) -> bool:
        exchange = getattr(self.inner, "device_exchange", None)
        return True if exchange is None else exchange(want, now)

    def allows(self, now: float) -> bool:
        """May a device NoExecute be written now: this node holds a slot (asked for one when it
        holds none; a take is a confirm), else confirmed right before the write. False: held by
        the budget."""
        return self._exchange("allow", now)

    def keep(self, now: float) -> None:
        """A device NoExecute already stands (an earlier run's): hold a slot for it if one is free."""
        self._exchange("keep", now)

    def written(self, now: float) -> None:
        """Right after a device NoExecute landed with a new slot: the slot re-written, so a reclaim
        that judged it before fails; a slot reclaimed meanwhile is said (the eviction stands)."""
        if not self._exchange("written", now):
            self.tally.count("budget_slot_lost", f"node={self.inner.node_name} a device NoExecute was "
                                                 "written as its budget slot was reclaimed")

    def settle(self, devices: tuple[str, ...], now: float) -> None:
        """The Node's annotation in step with the device NoExecutes that stand; the slot given back
        when none stands and the node carries no taint of the agent's (the node wants none)."""
        self.mark(devices)
        node = self.inner.node
        if not devices and node is not None and not owned_taints(node, self.taint_key):
            self._exchange("release", now)

    def mark(self, devices: tuple[str, ...]) -> bool:
        """The devices whose NoExecute stands, on the Node's annotation (no request when it shows
        them); False when the write failed (counted; tried again at the next reconcile)."""
        self.evicting = devices
        node = self.inner.node
        value = ",".join(devices) or None
        shown = self._marked[0] if self._marked is not None else (
            annotations_of(node).get(DEVICE_NO_EXECUTE_ANNOTATION) if node is not None else None)
        if shown != value:
            try:
                self.api.annotate_node(DEVICE_NO_EXECUTE_ANNOTATION, value)
                self._marked = (value,)
            except ApiError as exc:
                self.tally.count("write_failed", f"node={self.inner.node_name} {exc}")
                return False
        return True
