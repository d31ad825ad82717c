"""The budget's bound on a late disruptive write, on the fake API server with the real client.

A judge (``effects/budget_reclaim.py``) finds a slot stale when it has seen it unchanged for the
grace plus ``SLOT_GRACE_SECONDS`` while its holder's node shows no disruptive step. So the holder
confirms its slot with a write right before the disruptive step (every judge's clock starts
again), and sends that step with a server-side deadline of ``NODE_WRITE_DEADLINE_SECONDS``: it
lands within that of the confirm or not at all, never after a judge handed the slot on.

Time is the ``now`` argument; a write held up in the server's queue is the fake's ``queue_next``
(a request queued past its ``timeout`` parameter is answered 504 and changes nothing).
"""

from __future__ import annotations

import pytest

from healthagent.effects.backend import HOLD_WRITE_DEADLINE_SECONDS, NODE_WRITE_DEADLINE_SECONDS, ApiUnavailable
from healthagent.effects.budget import SLOT_GRACE_SECONDS, slot_name
from healthagent.effects.budget_guard import CONFIRM_MARGIN_SECONDS
from tests.effects.budget_helpers import LEASES, NAMESPACE, NODE, cluster, effects, held_by  # noqa: F401
from tests.effects.helpers import T0, XID95, Wakes, started

pytestmark = pytest.mark.integration

JUDGE = "gpu-node-7"
NO_GRACE = dict(budget_max_nodes=1, replace_noexecute_grace_seconds=0.0)


def no_executes(fake) -> int:
    return sum(effect == "NoExecute" for effect in effects(fake).values())


def test_a_noexecute_queued_past_a_judges_window_never_lands_beside_the_reclaimers(tmp_path, cluster):
    """The holder's NoExecute PATCH waits in the server's queue longer than a judge needs to find
    the slot stale; the judge reclaims it and takes its own disruptive step. The late PATCH must
    not land: with a limit of 1, never two nodes at NoExecute."""
    judge = started(tmp_path / "judge", cluster, node=JUDGE, **NO_GRACE)
    holder = started(tmp_path, cluster, **NO_GRACE)
    real_patch = holder.backend.patch_node
    peak: list[int] = []
    judged: list[bool] = []

    def queued_past_the_judge(patch, basis, disruptive=True):
        if "NoExecute" in str(patch) and not judged:
            judged.append(True)
            judge.reconcile(XID95, T0, "boot-1")  # the judge's first look: the slot is the holder's
            assert effects(cluster).get(JUDGE) == "NoSchedule"
            waited = SLOT_GRACE_SECONDS + 5
            judge.reconcile(XID95, max(judge.budget_recheck_at, T0 + waited), "boot-1")
            assert held_by(cluster, JUDGE) == [slot_name(0)]  # judged stale: no NoExecute on the holder
            cluster.queue_next("PATCH", f"/api/v1/nodes/{NODE}", waited)
        try:
            return real_patch(patch, basis, disruptive)
        finally:
            peak.append(no_executes(cluster))

    holder.backend.patch_node = queued_past_the_judge
    holder.reconcile(XID95, T0, "boot-1")
    assert peak and max(peak) <= 1
    # the late PATCH was answered 504 and changed nothing: the holder keeps the NoSchedule it had first
    assert effects(cluster) == {JUDGE: "NoExecute", NODE: "NoSchedule"}
    # its next try confirms again: the slot is the judge's now, so it stays held at NoSchedule
    status = holder.reconcile(XID95, T0 + SLOT_GRACE_SECONDS + 10, "boot-1")
    assert status.budget_blocked and effects(cluster) == {JUDGE: "NoExecute", NODE: "NoSchedule"}
    assert held_by(cluster, NODE) == []


def test_the_disruptive_write_carries_a_deadline_well_inside_the_judges_grace(tmp_path, cluster):
    """The NoExecute lands within its deadline or not at all; the NoSchedule before it (no slot
    behind it, nothing for a judge to hand on) may wait in the server's queue longer."""
    holder = started(tmp_path, cluster, **NO_GRACE)
    holder.reconcile(XID95, T0, "boot-1")
    cordon, step = [r for r in cluster.writes() if r.path == f"/api/v1/nodes/{NODE}"]
    assert "NoSchedule" in str(cordon.body) and cordon.query.get("timeout") == f"{HOLD_WRITE_DEADLINE_SECONDS}s"
    assert "NoExecute" in str(step.body) and step.query.get("timeout") == f"{NODE_WRITE_DEADLINE_SECONDS}s"
    (status,) = [r for r in cluster.writes() if r.path == f"/api/v1/nodes/{NODE}/status"]  # with the step
    assert status.query.get("timeout") == f"{NODE_WRITE_DEADLINE_SECONDS}s"
    assert NODE_WRITE_DEADLINE_SECONDS * 3 <= SLOT_GRACE_SECONDS


def test_the_confirm_rewrites_the_slot_so_no_judge_finds_it_stale_after_a_failed_step(tmp_path, cluster):
    """The holder's slot sat unchanged through its grace (NoSchedule, no disruptive step). Its
    confirm is a write, so a judge that first saw the slot before it measures from the confirm:
    a NoExecute that failed to land leaves the slot the holder's, not free for a reclaim."""
    settings = dict(budget_max_nodes=1)
    holder = started(tmp_path, cluster, **settings)
    judge = started(tmp_path / "judge", cluster, node=JUDGE, **settings)
    holder.reconcile(XID95, T0, "boot-1")  # NoSchedule with the slot
    judge.reconcile(XID95, T0 + 80, "boot-1")  # the judge sees the slot
    version = next(x for x in cluster.leases(NAMESPACE) if x["metadata"]["name"] == slot_name(0))[
        "metadata"]["resourceVersion"]
    cluster.reset_log()
    cluster.queue_next("PATCH", f"/api/v1/nodes/{NODE}", 3600)  # the NoExecute never lands
    holder.reconcile(XID95, T0 + 120, "boot-1")
    writes = [(r.method, r.path, r.status) for r in cluster.writes()]
    assert writes[:2] == [("PUT", f"{LEASES}/{slot_name(0)}", 200), ("PATCH", f"/api/v1/nodes/{NODE}", 504)]
    assert next(r for r in cluster.writes() if r.method == "PUT").body["metadata"]["resourceVersion"] == version
    judge.reconcile(XID95, T0 + 80 + SLOT_GRACE_SECONDS + 1, "boot-1")  # unchanged for it, without the confirm
    assert held_by(cluster, NODE) == [slot_name(0)] and effects(cluster) == {JUDGE: "NoSchedule", NODE: "NoSchedule"}


def test_a_slot_gone_at_the_confirm_rolls_back_and_one_that_cannot_be_written_holds(tmp_path, cluster):
    holder = started(tmp_path, cluster, budget_max_nodes=1)
    holder.reconcile(XID95, T0, "boot-1")
    store = holder.budget._store
    real_replace = store.replace

    def unwritable(body):
        raise ApiUnavailable("status=429 reason=TooManyRequests")

    store.replace = unwritable
    status = holder.reconcile(XID95, T0 + 120, "boot-1")
    assert effects(cluster)[NODE] == "NoSchedule" and holder.budget.slot is not None  # HOLDS: kept
    assert held_by(cluster, NODE) == [slot_name(0)]
    store.replace = real_replace
    cluster.handle("DELETE", f"{LEASES}/{slot_name(0)}", {}, "", None, "")  # removed by hand
    status = holder.reconcile(XID95, T0 + 121, "boot-1")
    assert effects(cluster)[NODE] == "NoSchedule" and holder.errors.get("budget_slot_lost") == 1  # ROLLBACK


def test_a_failed_rewrite_after_the_node_write_is_tried_again_at_the_next_reconcile(tmp_path, cluster):
    """After the NoExecute lands the slot is re-written; when that fails it is unknown whether the
    slot is still the node's, so the next reconcile writes it again (not after a long backoff)."""
    holder = started(tmp_path, cluster, **NO_GRACE)
    store = holder.budget._store
    real_replace, calls = store.replace, []

    def fails_after_the_node_write(body):
        calls.append(body)
        if len(calls) == 1:  # the take is a create; this is the re-write after the node write (settle)
            raise ApiUnavailable("status=504 reason=Timeout")
        return real_replace(body)

    store.replace = fails_after_the_node_write
    holder.reconcile(XID95, T0, "boot-1")
    assert effects(cluster)[NODE] == "NoExecute" and len(calls) == 1
    cluster.reset_log()
    holder.reconcile(XID95, T0 + 1, "boot-1")
    assert [(r.method, r.path) for r in cluster.writes(LEASES)] == [("PUT", f"{LEASES}/{slot_name(0)}")]


def test_a_confirm_grown_old_before_the_write_is_made_again_instead_of_writing(tmp_path, cluster):
    """The process stalled between the confirm and its node write (on the monotonic clock): the
    write is not sent on that slot write; the next reconcile (due at once) confirms the slot again,
    then writes the step."""
    holder = started(tmp_path, cluster, **NO_GRACE)
    wakes = Wakes()
    holder.on_change = wakes
    ticks = iter([0.0, CONFIRM_MARGIN_SECONDS + 30, 100.0, 100.5])  # take, stalled check, confirm, check
    holder.budget.clock = lambda: next(ticks)
    holder.reconcile(XID95, T0, "boot-1")
    writes = [(r.method, r.path) for r in cluster.writes() if r.path.startswith(LEASES) or r.path.endswith(NODE)]
    assert writes == [("PATCH", f"/api/v1/nodes/{NODE}"), ("POST", LEASES)] and wakes.count == 1
    assert effects(cluster) == {NODE: "NoSchedule"}  # the slot taken after the cordon; the NoExecute not sent
    holder.reconcile(XID95, T0 + 1, "boot-1")
    writes = [(r.method, r.path) for r in cluster.writes() if r.path.startswith(LEASES) or r.path.endswith(NODE)]
    assert writes[1:4] == [("POST", LEASES), ("PUT", f"{LEASES}/{slot_name(0)}"), ("PATCH", f"/api/v1/nodes/{NODE}")]
    assert effects(cluster) == {NODE: "NoExecute"}
