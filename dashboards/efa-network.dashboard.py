"""EFA network: per-device traffic, retransmits, timeouts, remote-peer events and port presence.

Counters come from the EFA driver's sysfs hw_counters (docs/reference/metrics.md lists them);
every one is cumulative, so panels show rates or per-interval increases. Port state is hard-coded
ACTIVE by the driver: the "Port state" panel really shows whether the device is still there.
"""

from dashboards.common import (
    RATE,
    GREEN_RED,
    cluster_variable,
    dashboard as build_dashboard,
    node_variable,
    sel,
    stat,
    state_timeline,
    target,
    timeseries,
    up_down_mappings,
)



def per_device_rate(counter: str, legend: str = "{{node}} {{efa_device}}") -> object:
    """Rate of one ``healthagent_efa_<counter>_total`` per node and device."""
    return target(f"sum by (node, efa_device) (rate({sel(f'healthagent_efa_{counter}_total')}{RATE}))", legend)


def per_device_increase(counter: str, legend: str) -> object:
    """Events of one counter per interval, per node and device (rare events read better as counts)."""
    return target(f"sum by (node, efa_device) (increase({sel(f'healthagent_efa_{counter}_total')}{RATE}))", legend)


dashboard = build_dashboard(
    title="healthagent / EFA network",
    uid="healthagent-efa",
    description="Elastic Fabric Adapter devices of every node: traffic, retransmits, timeouts, remote peers.",
    tags=["efa", "network"],
    variables=[cluster_variable(), node_variable()],
    rows=[
        (4, [
            stat("EFA devices present", "Devices the agents read now.",
                 [target(f"sum({sel('healthagent_efa_devices')})")]),
            stat("EFA devices expected", "Devices the instance types should have (0 = not configured).",
                 [target(f"sum({sel('healthagent_efa_devices_expected')})")]),
            stat("Devices missing", "Expected minus present, over the nodes that know what to expect.",
                 [target(f"sum(clamp_min(max by (node) ({sel('healthagent_efa_devices_expected')})"
                         f" - max by (node) ({sel('healthagent_efa_devices')}), 0))")], thresholds=GREEN_RED),
            stat("Ports up", "Ports present and reporting ACTIVE.",
                 [target(f"sum({sel('healthagent_efa_port_up')})")]),
        ]),
        (8, [
            timeseries("Transmit throughput", "Bytes sent per second, per device.",
                       [per_device_rate("tx_bytes")], unit="Bps"),
            timeseries("Receive throughput", "Bytes received per second, per device.",
                       [per_device_rate("rx_bytes")], unit="Bps"),
            timeseries("RDMA throughput", "RDMA read and write bytes per second, per device.",
                       [per_device_rate("rdma_read_bytes", "{{node}} {{efa_device}} read"),
                        per_device_rate("rdma_write_bytes", "{{node}} {{efa_device}} write")], unit="Bps"),
        ]),
        (8, [
            timeseries("Retransmitted packets / s", "SRD retransmits per device: a degrading path.",
                       [per_device_rate("retrans_pkts")], unit="pps"),
            timeseries("Retransmitted bytes / s", "SRD retransmitted bytes per device.",
                       [per_device_rate("retrans_bytes")], unit="Bps"),
            timeseries("Retransmit timeouts", "SRD timeouts that forced a path change, per interval.",
                       [per_device_increase("retrans_timeout_events", "{{node}} {{efa_device}}")], bars=True),
        ]),
        (8, [
            timeseries("Unresponsive / impaired remote peers",
                       "Events that point at the REMOTE peer: many nodes reporting them means the network, "
                       "one peer common to them means that peer.",
                       [per_device_increase("unresponsive_remote_events", "{{node}} {{efa_device}} unresponsive"),
                        per_device_increase("impaired_remote_conn_events", "{{node}} {{efa_device}} impaired")],
                       bars=True),
            timeseries("Drops and work-request errors", "Receive drops and RDMA work-request errors per interval.",
                       [per_device_increase("rx_drops", "{{node}} {{efa_device}} rx drops"),
                        per_device_increase("rdma_read_wr_err", "{{node}} {{efa_device}} read WR err"),
                        per_device_increase("rdma_write_wr_err", "{{node}} {{efa_device}} write WR err")],
                       bars=True),
            timeseries("Admin queue", "no_completion_cmds rising means the admin queue is stuck (reboot "
                       "candidate); cmds_err counts failed admin commands.",
                       [per_device_increase("no_completion_cmds", "{{node}} {{efa_device}} no completion"),
                        per_device_increase("cmds_err", "{{node}} {{efa_device}} cmd errors")], bars=True),
        ]),
        (10, [
            state_timeline("Port state", "Per device: up while the device is present and says ACTIVE (the driver "
                           "hard-codes ACTIVE; a vanished device leaves a gap, see Devices missing).",
                           [target(f"min by (node, efa_device) ({sel('healthagent_efa_port_up')})",
                                   "{{node}} {{efa_device}}")],
                           mappings=up_down_mappings(), thresholds=[{"color": "red", "value": None},
                                                                    {"color": "green", "value": 1}]),
            timeseries("Devices present vs expected", "EFA devices per node against the expected count.",
                       [target(f"max by (node) ({sel('healthagent_efa_devices')})", "{{node}} present"),
                        target(f"max by (node) ({sel('healthagent_efa_devices_expected')})", "{{node}} expected")],
                       step=True),
        ]),
    ],
)
