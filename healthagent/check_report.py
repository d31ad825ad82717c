"""What ``healthagent check`` collects and prints: the report a person reads on a suspect node,
the JSON a script reads, and the exit code both rely on.

Apart from the command line so the report can be read (and tested) on its own; the imports of
the agent's parts stay inside ``collect_once``, so the commands that only render start fast.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Iterable

from healthagent.config import Settings
from healthagent.model import Collection, natural_key
from healthagent.sources.base import read_boot_id

EXIT_CANNOT_RUN = 3


def collect_once(settings: Settings) -> Collection:
    """One collection from every configured source, as ``check`` and the demo show it. It carries
    the host's boot id, as the agent's do: rules that tell this boot from an earlier one (a
    ConnectX reboot-class event that comes back after a reboot is a replacement) decide in
    ``check`` as they decide in ``run`` on the same input."""
    # deferred: the agent's parts (about 0.4 s to import) load only when check collects
    from healthagent.agent import enrich_xid
    from healthagent.wiring import build_sources, expected_inventory

    now = time.time()
    boot_time = now - time.monotonic()  # on the same clock as now, measured without the wall clock
    expected = expected_inventory(settings)  # configured, else from the instance type
    sources = build_sources(settings).all()
    results = [source.collect(now) for source in sources]
    for source in sources:
        source.close()
    gpus = next((r.gpus for r in results if r.gpus and r.health.source == "nvml"), None) or next(
        (r.gpus for r in results if r.gpus), ())
    xids = tuple(enrich_xid(x, gpus) for r in results for x in r.xids)
    return Collection(
        timestamp=now, gpus=gpus, xids=xids, efa=tuple(s for r in results for s in r.efa),
        rdma=tuple(p for r in results for p in r.rdma), aer=tuple(a for r in results for a in r.aer),
        adapter_events=tuple(e for r in results for e in r.adapter_events),
        health=tuple(r.health for r in results), expected_gpus=expected[0], expected_efa_devices=expected[1],
        boot_time=boot_time, boot_id=read_boot_id(settings.host_root),
    )


def _table(rows: Iterable[Iterable[Any]], header: list[str]) -> str:
    rows = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _finding_subject(f) -> str:
    if f.gpu_index is not None:
        return f"GPU {f.gpu_index} ({f.pci_bus_id})" if f.pci_bus_id else f"GPU {f.gpu_index}"
    return f.pci_bus_id or f.fabric_device or "node"


def check_exit_code(verdict, nvml_asked: bool) -> int:
    """``check``'s exit code: the verdict's 0/1/2, but 3 (could not run) when the GPUs could not be
    observed and NVML was asked for, because "no finding" about GPUs nobody saw is not "healthy".
    A finding that already demands a node action stands (2): what was seen is enough to act on."""
    if verdict.action.needs_node_action:
        return 2
    if "gpu" in verdict.unobserved and nvml_asked:
        return EXIT_CANNOT_RUN
    return verdict.exit_code


_UNOBSERVED_WORDS = {"gpu": ("GPUs could not be observed", ("nvml", "dcgm")),
                     "efa": ("EFA devices could not be observed", ("efa",)),
                     "rdma": ("InfiniBand/RoCE ports could not be observed", ("rdma",)),
                     "kernel_log": ("The kernel log could not be read", ("kmsg",))}


def _unobserved_lines(collection, verdict) -> list[str]:
    lines = []
    for part in verdict.unobserved:
        title, sources = _UNOBSERVED_WORDS.get(part, (f"{part} could not be observed", ()))
        why = "; ".join(f"{h.source} {h.detail}".rstrip() for h in collection.health
                        if h.source in sources and not h.up)
        if not why and part == "gpu":
            why = f"no GPU source is configured, and {collection.expected_gpus} GPUs are expected"
        lines.append(f"{title}: {why or 'no source answered'}")
    return lines


def render_check(collection, verdict, exit_code: int | None = None, earlier_boot_xids: int = 0,
                 scope=None, gpu_scope: str = "") -> str:
    """The report a person reads on a suspect node: what was read, what could not be seen, then
    each finding as a block (what, why, the evidence, what to do next), most severe first."""
    lines = [f"GPUs: {len(collection.gpus)} read"]
    lines.append(_table(
        ([g.index, g.pci_bus_id, g.uuid, g.name, "LOST" if g.lost else "ok", g.temperature_c,
          g.power_w, g.ecc.aggregate_uncorrected, g.remap.pending, g.remap.failure]
         for g in collection.gpus),
        ["GPU", "PCI", "UUID", "MODEL", "STATE", "TEMP_C", "POWER_W", "DBE_AGG", "REMAP_PENDING",
         "REMAP_FAILURE"]))
    devices = sorted({s.device for s in collection.efa}, key=natural_key)
    lines.append("")
    lines.append(f"EFA devices: {len(devices)} read" + (f" ({devices[0]} .. {devices[-1]})" if devices else ""))
    lines.append("Sources:")
    lines.extend(f"  {h.source:<5} {'up' if h.up else 'DOWN':<4} {h.detail}".rstrip()
                 for h in collection.health)
    lines.append(f"XID events in the kernel log / NVML: {sum(x.repeats for x in collection.xids)}")
    if earlier_boot_xids:
        lines.append(f"{earlier_boot_xids} XID events from earlier boots (not judged)")
    lines.extend(_unobserved_lines(collection, verdict))
    lines.append("")
    code = verdict.exit_code if exit_code is None else exit_code
    meaning = {0: "healthy", 1: "degraded", 2: "node action required", 3: "could not run"}[code]
    if verdict.unobserved and code in (0, 1):
        meaning += " as far as seen; not observed: " + ", ".join(verdict.unobserved)
    lines.append(f"Verdict: {verdict.action.value} ({meaning})")
    for f in verdict.findings:
        lines.append("")
        lines.append(f"[{f.action.value}] {f.code} on {_finding_subject(f)}")
        lines.append(f"  what: {f.summary}")
        lines.append(f"  seen: {f.evidence}")
        lines.append(f"  next: {f.next_steps}")
        if scope is not None and scope.scope_of(f) == "gpu" and scope.device_effect(f):
            lines.append("  scope: gpu (one GPU, not the node; see GPU scope below)")
    if scope is not None and any(scope.scope_of(f) == "gpu" and scope.device_effect(f) for f in verdict.findings):
        lines.append("")
        lines.append(f"GPU scope: {gpu_scope or scope_words(scope)}")
    return "\n".join(lines)


NOT_SERVED_WORDS = ("the cluster does not serve DeviceTaintRules (resource.k8s.io/v1beta2: Kubernetes 1.36 with "
                    "the DRADeviceTaints and DRADeviceTaintRules feature gates and that API version turned on)")


def gpu_scope_report(settings: Settings, verdict, scope) -> str:
    """What the GPU-scope findings of ``verdict`` do on this node, asked of the cluster where
    ``check`` runs with cluster access (kube in-cluster or kubeconfig): one line, said once. Where
    the cluster does not serve DeviceTaintRules or the NVIDIA DRA driver does not publish the GPU,
    the line says that those findings act on the node and why. "" when the verdict has none.
    Reading the cluster never fails ``check``: a question it cannot ask is said as such."""
    # deferred: the DRA layer and the kubernetes client load only when a GPU-scope finding asks
    from healthagent.dra.effects import DraApi
    from healthagent.dra.slices import NVIDIA_GPU_DRIVER, device_map
    from healthagent.dra.split import NOT_PUBLISHED, NOT_SERVED, TOO_MANY, split_verdict
    from healthagent.effects.backend import ApiRejected

    if not split_verdict(verdict, scope, None).fallbacks:
        return ""
    if scope.dra == "off":
        return scope_words(scope)
    if settings.kube not in ("in-cluster", "kubeconfig") or not settings.node_name:
        why = f"kube={settings.kube}" if settings.node_name else "no node name (--node-name or NODE_NAME)"
        return f"{scope_words(scope)} (check asked no cluster: {why})"
    try:
        from healthagent.wiring import kube_api_client  # deferred: as above

        api = DraApi(kube_api_client(settings), settings.node_name, timeout=(2.0, 5.0))
        served = api.serves_rules()
        devices = device_map(api.slices(), settings.node_name) if served else None
    except ApiRejected as exc:
        return (f"GPU-scope findings act on the node: this agent's credentials may not read DeviceTaintRules "
                f"or ResourceSlices ({exc}); install deploy/components/dra for per-GPU quarantine")
    except Exception as exc:  # noqa: BLE001 - ApiError, a setup the client cannot use (ConfigError)
        return f"{scope_words(scope)} (check could not ask the cluster: {' '.join(str(exc).split())[:160]})"
    split = split_verdict(verdict, scope, devices)
    why = {NOT_SERVED: NOT_SERVED_WORDS,
           NOT_PUBLISHED: (f"the NVIDIA DRA driver ({NVIDIA_GPU_DRIVER}) publishes no ResourceSlice device of node "
                           f"{settings.node_name} for " + ", ".join(_unpublished(verdict, scope, devices))),
           TOO_MANY: (f"more GPUs need a reset at once than scope.gpu_quarantine_max={scope.gpu_quarantine_max}, "
                      "so the node is the unit")}
    steps = {"NoExecute": "NoSchedule, then NoExecute after the grace while the node holds a disruption-budget slot"}
    parts = [f"the agent quarantines GPU {q.findings[0].gpu_index} alone with a DeviceTaintRule on {q.ref.path} "
             f"({steps.get(q.effect, q.effect)}); the node stays in service" for q in split.quarantines]
    if split.fallbacks:
        parts.append("GPU-scope findings act on the node: " + "; ".join(why[r] for r in split.fallbacks))
    return ". ".join(parts)


def _unpublished(verdict, scope, devices) -> list[str]:
    return [f"GPU {f.gpu_index} ({f.uuid or f.pci_bus_id})" for f in verdict.findings
            if scope.scope_of(f) == "gpu" and scope.device_effect(f) and devices is not None
            and devices.find(f.uuid, f.pci_bus_id) is None]


def scope_words(scope) -> str:
    """What a gpu-scope finding does, as ``check`` (which reads no cluster) can say it."""
    if scope.dra == "off":
        return "DRA is off in the policy file (scope.dra): the node acts"
    return ("the agent quarantines this one GPU with a DRA DeviceTaintRule where the cluster serves "
            "DeviceTaintRules and the NVIDIA DRA driver publishes the GPU; otherwise the node acts, "
            "and the agent says so (healthagent_gpu_quarantine_fallback)")


def check_json(collection, verdict, exit_code: int | None = None, earlier_boot_xids: int = 0) -> dict[str, Any]:
    def finding(f):
        d = asdict(f)
        d["action"] = f.action.value
        return d

    return {
        "verdict": verdict.action.value,
        "exit_code": verdict.exit_code if exit_code is None else exit_code,
        "unobserved": list(verdict.unobserved),
        "findings": [finding(f) for f in verdict.findings],
        # ``reset`` compares two reads of a GPU; check reads each once, so it never has one to say
        "gpus": [{k: v for k, v in asdict(g).items() if k != "reset"} for g in collection.gpus],
        "efa_devices": sorted({s.device for s in collection.efa}, key=natural_key),
        "sources": [asdict(h) for h in collection.health],
        "xid_events": sum(x.repeats for x in collection.xids),
        "xid_events_earlier_boots": earlier_boot_xids,
    }
