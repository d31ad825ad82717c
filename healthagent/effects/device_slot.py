"""The budget exchange of a device NoExecute (``healthagent/dra``), run on the driver's one state.

A device taint with effect NoExecute evicts a GPU's pods, and with them a rank of an elastic job,
as the node's NoExecute evicts the node's: it takes the node's own slot. The exchange runs through
the node's ``BudgetGuard`` on the node driver's ``DriverState`` (``NodeEffects.device_exchange``),
so the node path and the device path never hold two views of one slot. The node shows a device
NoExecute in its annotation (``budget_reclaim.DEVICE_NO_EXECUTE_ANNOTATION``): the reclaim reads it
as the holder's disruptive step, and the guard keeps the slot for it.
"""

from __future__ import annotations

from typing import Literal

from healthagent.effects.budget_guard import BudgetGuard, GuardState
from healthagent.effects.plan import Budget

# allow: may a device NoExecute be written now (a slot held and confirmed, or taken: a take is a
#        confirm); keep: hold a slot for a device NoExecute already standing, if one is free;
# written: re-write the slot right after a NoExecute landed with it (a reclaim that judged it
#        before fails); release: no device NoExecute stands and the node wants no slot.
Want = Literal["allow", "keep", "written", "release"]


def device_exchange(guard: BudgetGuard, g: GuardState, node: dict | None, want: Want, now: float,
                    wall: float) -> tuple[GuardState, bool]:
    """(the guard's state after the exchange, the answer). ``allow`` and ``keep``: True when this
    node holds a slot; ``written``: False when the slot was found reclaimed (the eviction stands and
    is counted); ``release``: True."""
    g = guard.begin(g)
    if want in ("allow", "keep"):
        if not guard.held(g):
            g, answer = guard.ask(g, now, wall, node)
            return g, answer is Budget.ALLOWS
        if want == "keep":
            return g, True
        g, answer = guard.confirm(g, now, wall)
        return g, answer is Budget.ALLOWS
    if want == "written":
        if g.slot is None:
            return g, True
        g, answer = guard.confirm(g, now, wall)
        return g, answer is not Budget.ROLLBACK
    if node is None:
        return g, True
    g, _ = guard.settle(g, node, now, wall, wants_slot=False)
    return g, True
