"""The finding codes, what each one demands by default, and the words an on-call engineer reads.

Codes are a contract (alerts, dashboards and ``docs/findings.md#<code>`` anchors use them), so they
live in one table here; ``settings`` validates ``disabled_rules`` against it and the docs test
checks that every code has its section. The texts are short on purpose: ``check`` prints them in a
table, and the full runbook is one link away.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from healthagent.model import Action

DOCS = "docs/findings.md"


@dataclass(frozen=True)
class FindingInfo:
    """One finding code: its default action (None = decided per event by a catalog: the XID
    catalog, or for RDMA_ADAPTER_EVENT the mlx5 one)."""

    code: str
    title: str
    action: Action | None
    next_steps: str

    @property
    def runbook(self) -> str:
        return f"{DOCS}#{self.code.lower()}"


_INFOS = (
    FindingInfo("GPU_XID", "XID incident on a GPU", None, ""),
    FindingInfo("NVSWITCH_SXID", "NVSwitch SXid incident", None,
                "Check `nvidia-smi -q` and the fabric manager log (/var/log/fabricmanager.log); "
                "a fatal SXid needs the GPUs and NVSwitches reset: drain and reboot the node."),
    FindingInfo("GPU_ECC_DBE", "uncorrectable (double-bit) ECC errors", Action.RESET_GPU,
                "Drain {gpu}, then reset it (`nvidia-smi -r -i {index}`) so the pending row remap "
                "takes effect; reboot if the reset fails. Replace the node if DBEs return."),
    FindingInfo("GPU_SBE_STORM", "accelerating corrected (single-bit) ECC errors", Action.MONITOR,
                "Corrected errors are climbing fast on {gpu}: plan a drain, then run "
                "`dcgmi diag -r 3`; DBEs usually follow a storm like this."),
    FindingInfo("GPU_ROW_REMAP_FAILURE", "row remapping failed", Action.REPLACE_NODE,
                "{gpu} has no spare rows left (NVIDIA: RMA). Keep it out of jobs, collect "
                "`nvidia-bug-report.sh`, replace the node."),
    FindingInfo("GPU_ROW_REMAP_PENDING", "row remap waiting for a GPU reset", Action.RESET_GPU,
                "Drain {gpu}, then reset it (`nvidia-smi -r -i {index}`) or reboot the node; the "
                "pending remap is applied by the reset."),
    FindingInfo("GPU_RETIRED_PAGES", "retired pages over NVIDIA's RMA limit", Action.REPLACE_NODE,
                "{gpu} has retired too many pages (NVIDIA: RMA). Keep it out of jobs, collect "
                "`nvidia-bug-report.sh`, replace the node."),
    FindingInfo("GPU_RETIRED_PAGES_PENDING", "page retirement waiting for a driver reload",
                Action.RESET_GPU,
                "Drain {gpu}, then reset it (`nvidia-smi -r -i {index}`) or reboot so the driver "
                "retires the pending pages."),
    FindingInfo("GPU_LOST", "GPU lost (NVML: GPU_IS_LOST)", Action.REBOOT_NODE,
                "The agent taints the node NoSchedule, then NoExecute after the grace (within the "
                "disruption budget); let the job "
                "checkpoint, then reboot. If "
                "{gpu} is lost again after the reboot, replace the node."),
    FindingInfo("GPU_MISSING", "fewer GPUs than expected", Action.REBOOT_NODE,
                "Check `nvidia-smi -L` and `lspci | grep -i nvidia`; drain and reboot. If the GPU "
                "is still missing after the reboot, replace the node."),
    FindingInfo("GPU_INIT_FAILED", "GPU failed to initialise (RmInitAdapter failed)", Action.REBOOT_NODE,
                "The driver could not initialise {gpu}: it is not usable. The agent taints the node "
                "NoSchedule; collect `nvidia-bug-report.sh`, then drain and reboot (a stop and start "
                "of the instance if a reboot does not bring it back). If it fails again, replace the "
                "node."),
    FindingInfo("GPU_NVLINK_ERRORS", "NVLink errors growing", Action.MONITOR,
                "Check `nvidia-smi nvlink -e -i {index}`; if errors keep growing or XID 74 appears, "
                "drain and reset the GPU, then run `dcgmi diag -r 2`."),
    FindingInfo("GPU_PCIE_REPLAY", "PCIe replays growing", Action.MONITOR,
                "Check `nvidia-smi -q -d PCIE -i {index}` for link width/speed; persistent replays "
                "point at the riser or slot: plan a drain and hardware check."),
    FindingInfo("GPU_THERMAL_THROTTLE", "sustained hardware thermal slowdown", Action.MONITOR,
                "{gpu} runs slowed by heat: check `nvidia-smi -q -d TEMPERATURE,PERFORMANCE` and "
                "the chassis fans/airflow; the job is slower, not broken."),
    FindingInfo("GPU_POWER_THROTTLE", "sustained power-brake slowdown", Action.MONITOR,
                "{gpu} runs slowed by the power brake: check the PSUs and the BMC power log; the "
                "job is slower, not broken."),
    FindingInfo("EFA_DEVICE_MISSING", "EFA device missing", Action.REBOOT_NODE,
                "Check `fi_info -p efa` and `ls /sys/class/infiniband`; drain and reboot. If the "
                "device is still missing after the reboot, replace the node."),
    FindingInfo("EFA_ADMIN_QUEUE_STUCK", "EFA admin queue stuck", Action.REBOOT_NODE,
                "The EFA driver stopped its admin queue on {device}: drain and reboot the node; "
                "replace it if this repeats."),
    FindingInfo("EFA_CMD_ERRORS", "EFA admin command errors", Action.MONITOR,
                "Admin commands fail on {device}: check `dmesg | grep -i efa` and the EFA driver "
                "version; usually configuration or driver, rarely hardware."),
    FindingInfo("EFA_UNRESPONSIVE_REMOTE", "EFA peers unresponsive", Action.MONITOR,
                "This node's EFA ({device}) reports unresponsive peers: look for the node that "
                "many peers report (the fault is usually there), not this one."),
    FindingInfo("EFA_IMPAIRED_REMOTE", "EFA connections to peers impaired", Action.MONITOR,
                "Connections from {device} are rate-limited: look for the peer node many nodes "
                "report; check its EFA findings."),
    FindingInfo("EFA_RETRANS_TIMEOUT", "EFA retransmit timeouts", Action.MONITOR,
                "SRD timed out and changed path on {device}: a network path or a peer is failing; "
                "compare with other nodes in the job before draining this one."),
    FindingInfo("EFA_RX_DROPS", "EFA receive drops", Action.MONITOR,
                "Packets are dropped on {device}: check the job's buffer settings and the "
                "instance's network limits; drain only if it persists with a healthy job."),
    FindingInfo("EFA_WR_ERRORS", "EFA RDMA work-request errors", Action.MONITOR,
                "RDMA work requests fail on {device}: usually application or libfabric/NCCL "
                "configuration (memory registration); check the job's logs first."),
    FindingInfo("RDMA_PORT_DOWN", "InfiniBand/RoCE port down", Action.REBOOT_NODE,
                "Port {device} was up (or the policy file's rdma_ports: says it must be) and is not: "
                "its jobs' NCCL traffic on it has failed. Check the cable, transceiver and switch "
                "port (`ibstat`, `mlxlink -d <pci> -m`), fix the link, then reboot the node (or clear "
                "it) to return it to the job."),
    FindingInfo("RDMA_PORT_DEGRADED", "InfiniBand/RoCE port below its rate", Action.MONITOR,
                "Port {device} trained below the rate it (or its sibling ports, or rdma_ports:) "
                "expects: the job's collectives run at the slowest rail. Plan a drain; reseat or "
                "replace the cable (`mlxlink -d <pci> -m -e` for lanes and BER)."),
    FindingInfo("RDMA_LINK_FLAPPING", "InfiniBand/RoCE link flapping", Action.REBOOT_NODE,
                "The link of {device} went down and came back repeatedly (link_downed): every flap "
                "breaks the job's queue pairs. Drain, replace the cable or transceiver or move the "
                "switch port, then return the node."),
    FindingInfo("RDMA_SYMBOL_ERRORS", "InfiniBand symbol errors", Action.MONITOR,
                "Symbol errors are climbing on {device}: a marginal cable, transceiver or connector. "
                "Check `mlxlink -d <pci> -m -c` (BER, FEC) and plan a cable swap."),
    FindingInfo("RDMA_LINK_ERRORS", "InfiniBand link integrity errors", Action.MONITOR,
                "The link of {device} keeps retraining or losing integrity: check the cable and the "
                "switch port's counters (`perfquery`), and watch for link_downed."),
    FindingInfo("RDMA_RCV_ERRORS", "InfiniBand receive errors", Action.MONITOR,
                "Packets with errors are received on {device}: check this link and the peer's "
                "(`perfquery -x` on both ends); remote physical errors point at the far side."),
    FindingInfo("RDMA_XMIT_DISCARDS", "InfiniBand transmit discards", Action.MONITOR,
                "Outbound packets are discarded on {device} (port down or congestion): look at "
                "port_xmit_wait and the fabric's congestion before draining this node."),
    FindingInfo("RDMA_ADAPTER_EVENT", "ConnectX (mlx5) adapter event in the kernel log", None,
                "Do what the event's row of the mlx5 catalog says (docs/findings.md#rdma_adapter_event); "
                "a fatal or hung adapter takes the node out: drain and reboot, and replace the adapter "
                "if it fails again after the reboot."),
    FindingInfo("RDMA_DEVICE_MISSING", "RDMA device missing", Action.REBOOT_NODE,
                "An InfiniBand/RoCE device seen earlier is gone: check `ibstat`, `lspci | grep -i "
                "mellanox` and `dmesg | grep mlx5`; drain and reboot. If it is still missing after the "
                "reboot, replace the node."),
)

FINDINGS: dict[str, FindingInfo] = {info.code: info for info in _INFOS}
FINDING_CODES: tuple[str, ...] = tuple(FINDINGS)

# What an on-call engineer does for an XID incident, by the action it demands.
ACTION_STEPS: dict[Action, str] = {
    Action.NONE: "Nothing to do.",
    Action.MONITOR: "No action on the node now. If it repeats, run `healthagent explain {xid}` and "
                    "attach `nvidia-bug-report.sh` to a case with NVIDIA.",
    Action.RESTART_APP: "The application faulted, not the node: restart the job from its last "
                        "checkpoint and read its CUDA error. If the same XID follows this GPU "
                        "across jobs, drain the node and run `dcgmi diag -r 3`.",
    Action.RESET_GPU: "Drain the workloads on {gpu}, then reset it (`nvidia-smi -r -i {index}`); if "
                      "the reset fails or the XID returns, reboot the node.",
    Action.REBOOT_NODE: "The agent taints the node (NoSchedule, then NoExecute after the grace, within the "
                        "disruption budget): let the job "
                        "checkpoint and scale down, then "
                        "drain and reboot. The finding clears after the reboot if checks pass; if "
                        "it returns, replace the node.",
    Action.REPLACE_NODE: "The agent taints the node (NoSchedule, then NoExecute after the grace, within the "
                         "disruption budget): do not "
                         "return it to the job. Collect `nvidia-bug-report.sh` and replace the "
                         "instance; the finding stays until the GPU is replaced or an operator "
                         "clears it.",
}

# Plain words for what an action means, used at the end of summaries.
ACTION_WORDS: dict[Action, str] = {
    Action.NONE: "no action",
    Action.MONITOR: "informational, no action on the node",
    Action.RESTART_APP: "the application faulted; the GPU is expected to be healthy",
    Action.RESET_GPU: "the GPU needs a reset before it can be trusted",
    Action.REBOOT_NODE: "the node needs a reboot",
    Action.REPLACE_NODE: "the node must be replaced",
}


def gpu_words(index: int | None, pci_bus_id: str) -> str:
    """"GPU 3 (0000:a8:00.0)", "GPU 0000:a8:00.0" or "an unknown GPU"."""
    if index is not None and pci_bus_id:
        return f"GPU {index} ({pci_bus_id})"
    if index is not None:
        return f"GPU {index}"
    if pci_bus_id:
        return f"GPU {pci_bus_id}"
    return "an unknown GPU"


def fill(template: str, *, index: int | None = None, pci_bus_id: str = "", device: str = "",
         xid: int | None = None) -> str:
    """Fill a next-steps template; an unknown GPU index becomes a placeholder the reader fills."""
    return template.format(
        gpu=gpu_words(index, pci_bus_id), index=index if index is not None else "<index>",
        device=device or "the device", xid=xid if xid is not None else "<xid>",
    )


def steps_for(code: str, **where) -> str:
    info = FINDINGS[code]
    return f"{fill(info.next_steps, **where)} Runbook: {info.runbook}"


def clock(t: float) -> str:
    """A timestamp as UTC wall time for evidence ("10:11:12"); formatting only, no clock read."""
    try:
        return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"t={t:.0f}"


def day(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d")
    except (OverflowError, OSError, ValueError):
        return "?"


def span_words(start: float, end: float) -> str:
    """"at 10:11:12 UTC on 2024-05-01" or "between 10:11:12 and 10:11:40 UTC on 2024-05-01"."""
    if end - start < 1:
        return f"at {clock(start)} UTC on {day(start)}"
    return f"between {clock(start)} and {clock(end)} UTC on {day(start)}"


def duration_words(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
