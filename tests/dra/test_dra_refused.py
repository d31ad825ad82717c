"""A refused DRA read is no proof that no rule exists, on a real kube-apiserver v1.36.

An agent restarts while its device NoExecute rule stands; the restarted agent's first
ResourceSlice read is answered 403 (its RBAC not effective yet: a fault injected in process, the
real ``DraApi`` underneath), so the GPU's finding acts on the node meanwhile. The finding then
closes. The rule an earlier run left is still looked for, after the refusal's back-off, and
removed: no GPU stays tainted on a healed node. And a device NoExecute whose rule write is refused
gives back the Node's annotation and the budget slot taken for it: no slot held for an eviction
that did not happen.
"""

from __future__ import annotations

import pytest

from healthagent.dra.effects import REFRESH_SECONDS, DraApi, DraEffects
from healthagent.effects.backend import ApiRejected
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.model import Verdict
from healthagent.policy.scope import ScopePolicy
from tests.dra.slices import gpu_finding
from tests.dra.test_dra_real import GRACE, _agent, _rules
from tests.effects.helpers import T0, settings_for

pytestmark = pytest.mark.integration


def _with_api(plane, folder, node: str, api: type[DraApi], scope: ScopePolicy) -> DraEffects:
    """An agent of ``node`` whose DRA calls go through ``api`` (the real DraApi with a fault)."""
    settings = settings_for(folder, node, kube="kubeconfig", replace_noexecute_grace_seconds=GRACE,
                            budget_namespace=f"budget-{node}")
    store = StateStore(settings.state_file)
    store.load()
    api_client = plane.api_client()
    inner = NodeEffects(settings, api_client, store, watch=False, request_timeout=(2.0, 5.0))
    return DraEffects(inner, api(api_client, node), scope, settings.taint_key, GRACE)


class _RefusedOnce(DraApi):
    """The real DraApi whose first ResourceSlice list is answered 403."""

    refused = 0

    def list_slices(self):
        if not type(self).refused:
            type(self).refused += 1
            raise ApiRejected(403, "Forbidden", "resourceslices is forbidden (injected)")
        return super().list_slices()


def test_a_rule_left_by_an_earlier_run_is_removed_after_a_refused_read(dra_plane, tmp_path):
    node = "dra-refused"
    scope = ScopePolicy(noexecute=True)
    first = _agent(dra_plane, tmp_path / "first", node, scope)
    bad = Verdict.of([gpu_finding(3)], T0)
    for now in (T0, T0 + GRACE + 1):
        first.reconcile(bad, now, "boot-1")
    assert [r["spec"]["taint"]["effect"] for r in _rules(dra_plane, node)] == ["NoExecute"]
    first.close()

    again = _with_api(dra_plane, tmp_path / "again", node, _RefusedOnce, scope)
    start = T0 + 300
    again.startup(start, "boot-1")
    again.reconcile(Verdict.of([gpu_finding(3)], start), start, "boot-1")
    assert _RefusedOnce.refused == 1 and again.served is False  # the GPU's finding acts on the node now
    healed = Verdict.of([], start + 1)  # the GPU was reset: the finding closed
    again.reconcile(healed, start + 1, "boot-1")
    again.reconcile(healed, start + REFRESH_SECONDS + 2, "boot-1")  # the refusal's back-off has passed
    assert _rules(dra_plane, node) == []
    again.close()


class _NoExecuteRefused(DraApi):
    """The real DraApi whose rule writes with effect NoExecute are refused 422 (an admission
    policy the cluster added, say), injected in process."""

    def replace(self, name, body):
        if body["spec"]["taint"]["effect"] == "NoExecute":
            raise ApiRejected(422, "Invalid", "NoExecute refused (injected)")
        return super().replace(name, body)


def test_a_device_noexecute_whose_rule_write_is_refused_gives_its_mark_and_slot_back(dra_plane, tmp_path):
    from kubernetes import client

    from healthagent.effects.budget_reclaim import DEVICE_NO_EXECUTE_ANNOTATION

    node = "dra-refused-write"
    _agent(dra_plane, tmp_path / "setup", node, ScopePolicy(noexecute=True)).close()  # the node, its slices
    effects = _with_api(dra_plane, tmp_path / "agent", node, _NoExecuteRefused, ScopePolicy(noexecute=True))
    effects.startup(T0 - 1, "boot-1")
    bad = Verdict.of([gpu_finding(3)], T0)
    effects.reconcile(bad, T0, "boot-1")
    effects.reconcile(bad, T0 + GRACE + 1, "boot-1")  # NoExecute due: the slot taken, the write refused
    assert [r["spec"]["taint"]["effect"] for r in _rules(dra_plane, node)] == ["NoSchedule"]
    annotations = client.CoreV1Api(dra_plane.api_client()).read_node(node).metadata.annotations or {}
    assert DEVICE_NO_EXECUTE_ANNOTATION not in annotations
    leases = client.CoordinationV1Api(dra_plane.api_client()).list_namespaced_lease(f"budget-{node}").items
    assert not [lease for lease in leases if lease.metadata.name.startswith("healthagent-budget-slot")
                and lease.spec.holder_identity == node]
    effects.close()
