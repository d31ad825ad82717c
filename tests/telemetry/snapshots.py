"""Snapshots shaped like the demo node (p5.48xlarge: 8 x H100, 32 EFA devices) for the exporter tests.

Built from the real records in ``healthagent.model`` and the EFA counter names of the amzn driver
(``tests/fixtures/efa/efa-counters.txt``), so the exporter renders what the loop publishes.
"""

from __future__ import annotations

from healthagent.model import (
    Action,
    AgentSnapshot,
    EccCounts,
    EfaSample,
    Finding,
    GpuSample,
    KubeStatus,
    RemapState,
    RetiredPages,
    SourceHealth,
    Verdict,
    XidCount,
)
from healthagent.effects.stage import started
from tests.support.efa_reference import efa_counter_facts

NOW = 1_760_000_000.0
GPUS = 8
EFA_DEVICES = 32

# Every hw_counter file of a current driver (port + device), lifespan included: the exporter
# must leave it out. Read from the independent copy of the reference, not from the code under test.
EFA_COUNTERS = tuple(sorted(efa_counter_facts()))


def pci(index: int) -> str:
    return f"0000:{0x53 + index * 0x10:02x}:00.0"


def uuid(index: int) -> str:
    return f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}"


def demo_gpus() -> tuple[GpuSample, ...]:
    gpus = []
    for i in range(GPUS):
        gpus.append(GpuSample(
            index=i, uuid=uuid(i), pci_bus_id=pci(i), name="NVIDIA H100 80GB HBM3",
            driver_version="550.90.07",
            ecc=EccCounts(volatile_corrected=i, volatile_uncorrected=0, aggregate_corrected=10 + i,
                          aggregate_uncorrected=1 if i == 3 else 0),
            remap=RemapState(correctable=i % 2, uncorrectable=0, pending=False, failure=i == 5),
            retired_pages=RetiredPages(single_bit=0, double_bit=2 if i == 3 else 0, pending=False),
            throttle_reasons=("hw_thermal_slowdown", "sw_power_cap") if i == 2 else ("gpu_idle",),
            nvlink_errors={"replay": i, "recovery": 0, "crc_flit": 2, "crc_data": 0},
            pcie_replay=7 * i, temperature_c=40.0 + i, power_w=300.0 + 10 * i, timestamp=NOW,
        ))
    return tuple(gpus)


def demo_efa(devices: int = EFA_DEVICES) -> tuple[EfaSample, ...]:
    samples = []
    for d in range(devices):
        counters = {name: 1000 * d + n for n, name in enumerate(EFA_COUNTERS)}
        samples.append(EfaSample(device=f"rdmap{16 + d}s0", port=1, counters=counters,
                                 pci_bus_id=f"0000:{0x10 + d:02x}:00.0", port_state="4: ACTIVE",
                                 phys_state="5: LinkUp", timestamp=NOW))
    return tuple(samples)


def demo_verdict() -> Verdict:
    findings = (
        Finding(code="GPU_XID", action=Action.REPLACE_NODE, summary="XID 79: GPU fell off the bus",
                evidence="NVRM: Xid (PCI:0000:83:00): 79", next_steps="replace the node",
                gpu_index=3, pci_bus_id=pci(3), uuid=uuid(3), xids=(79,), first_seen=NOW - 5,
                last_seen=NOW - 5),
        Finding(code="GPU_XID", action=Action.MONITOR, summary="XID 13", evidence="Xid 13",
                next_steps="watch", gpu_index=1, pci_bus_id=pci(1), uuid=uuid(1), xids=(13,),
                first_seen=NOW - 50, last_seen=NOW - 50),
        Finding(code="GPU_XID", action=Action.MONITOR, summary="XID 13", evidence="Xid 13",
                next_steps="watch", gpu_index=2, pci_bus_id=pci(2), uuid=uuid(2), xids=(13,),
                first_seen=NOW - 40, last_seen=NOW - 40),
        Finding(code="EFA_RX_DROPS", action=Action.MONITOR, summary="rx drops rising",
                evidence="rx_drops +500/min", next_steps="check the fabric", fabric_device="rdmap16s0",
                first_seen=NOW - 30, last_seen=NOW),
    )
    return Verdict.of(findings, NOW)


def demo_snapshot(**overrides) -> AgentSnapshot:
    fields = dict(
        timestamp=NOW, gpus=demo_gpus(), efa=demo_efa(),
        xid_counts=(
            XidCount(xid=79, count=1, gpu_index=3, uuid=uuid(3), pci_bus_id=pci(3)),
            XidCount(xid=13, count=2, gpu_index=1, uuid=uuid(1), pci_bus_id=pci(1)),
            XidCount(xid=13, count=1, gpu_index=2, uuid=uuid(2), pci_bus_id=pci(2)),
            # Two tallies whose GPU is unknown share the label set gpu="" uuid="": summed.
            XidCount(xid=48, count=1, pci_bus_id="0000:99:00.0"),
            XidCount(xid=48, count=2, pci_bus_id="0000:9a:00.0"),
            XidCount(xid=12028, count=3, pci_bus_id="0000:05:00.0", kind="sxid"),
        ),
        health=(
            SourceHealth(source="nvml", up=True, errors={}),
            SourceHealth(source="efa", up=True, errors={"unreadable": 2}),
            SourceHealth(source="kmsg", up=True, errors={"parse": 5, "dropped": 1}),
            SourceHealth(source="dcgm", up=False, detail="connection refused", errors={"timeout": 4}),
        ),
        verdict=demo_verdict(),
        kube=KubeStatus(mode="in-cluster", reachable=True, taint_effect="NoSchedule",
                        budget_blocked=False, budget_blocked_total=2,
                        writes={("node", "ok"): 3, ("node", "conflict"): 1, ("event", "ok"): 4,
                                ("node_status", "error"): 1},
                        pending_writes=0, taint_action="replace_node", budget_scope="", budget_limit=2,
                        budget_slots_held=1, conditions_owned_elsewhere=0),
        ready=True, expected_gpus=8, expected_efa_devices=32,
        # healthy until T0 - 600, observing for 5 minutes, cordoned since T0 - 300
        stage=started(NOW - 900, NOW - 900).advance("observing", "GPU_XID", NOW - 600, NOW - 600)
        .advance("cordoned", "GPU_XID", NOW - 300, NOW - 300),
    )
    fields.update(overrides)
    return AgentSnapshot(**fields)
