"""InfiniBand and RoCE fabric: each port's state, rate, traffic, link flaps, errors and congestion,
and the ConnectX (mlx5) adapter events the agent read in the kernel log.

Counters carry node_exporter's infiniband names under the agent's prefix (docs/reference/metrics.md), with
the labels ``device`` and ``port``; every one is cumulative, so panels show rates or per-interval
increases. Unlike EFA, a port's state is real here: "Port state" shows a link that is down.

Adapter events are ``healthagent_mlx5_events_total{device,pci_bus_id,event}``, this boot's count.
The fatal-class events are read from the mlx5 catalog at generation time (its rows whose action
takes the node out), the same rows the ``HealthagentRdmaAdapterFatal`` alert names: after a
catalog change the committed JSON is stale, and the tests say so, until it is regenerated.
"""

from dashboards.common import (
    GREEN_RED,
    RATE,
    cluster_variable,
    dashboard as build_dashboard,
    node_variable,
    sel,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
    up_down_mappings,
)
from healthagent.model import Action
from healthagent.policy.mlx5_catalog import bundled_rows

PORT = "{{node}} {{device}}/{{port}}"
RDMA_CODES = 'code=~"RDMA_.*"'
ADAPTER = "{{node}} {{device}} {{pci_bus_id}} {{event}}"
# The catalog's events whose action takes the node out (reboot_node), in the catalog's order.
FATAL_EVENTS = tuple(row["event"] for row in bundled_rows() if Action.parse(row["action"]).needs_node_action)
FATAL = 'event=~"' + "|".join(FATAL_EVENTS) + '"'


def per_port(function: str, counter: str, legend: str = PORT) -> object:
    """``function`` (rate or increase) of one ``healthagent_infiniband_<counter>`` per node and port."""
    return target(f"sum by (node, device, port) ({function}({sel(f'healthagent_infiniband_{counter}')}{RATE}))",
                  legend)


def adapter_events_per_interval() -> str:
    """Events per interval by node, adapter and event, an adapter's first ones included.

    A series of the counter starts with its adapter's first event of the boot (at 1, not 0), which
    ``increase()`` never sees; most adapters log one event a boot. So while a series is younger
    than the interval (absent ``offset`` one interval back) its count is the increase.
    """
    by = "sum by (node, device, pci_bus_id, event)"
    counter = sel("healthagent_mlx5_events_total")
    return (f"{by} ({counter} unless {counter} offset $__rate_interval)"
            f" or {by} (increase({counter}{RATE}))")


dashboard = build_dashboard(
    title="healthagent / InfiniBand and RoCE fabric",
    uid="healthagent-rdma",
    description="InfiniBand and RoCE ports of every node: state, rate, traffic, link flaps, errors, congestion.",
    tags=["infiniband", "roce", "network"],
    variables=[cluster_variable(), node_variable()],
    rows=[
        (4, [
            stat("Ports up", "Ports ACTIVE with their link up.",
                 [target(f"sum({sel('healthagent_infiniband_port_up')})")]),
            stat("Ports not up", "Ports that are not ACTIVE with their link up (an unused port counts too).",
                 [target(f"count({sel('healthagent_infiniband_port_up')} == 0)")], thresholds=GREEN_RED),
            stat("Ports below their rate", "Up ports running below the highest rate they showed in 6 hours.",
                 [target(f"count(({sel('healthagent_infiniband_rate_bytes_per_second')} < max_over_time("
                         f"{sel('healthagent_infiniband_rate_bytes_per_second')}[6h])) and on (node, device, port) "
                         f"({sel('healthagent_infiniband_port_up')} == 1))")], thresholds=GREEN_RED),
            stat("Open fabric findings", "RDMA_* findings open now (docs/findings.md).",
                 [target(f"sum({sel('healthagent_findings', RDMA_CODES)})")], thresholds=GREEN_RED),
        ]),
        (8, [
            state_timeline("Port state", "Per port: up while ACTIVE with the link up.",
                           [target(f"min by (node, device, port) ({sel('healthagent_infiniband_port_up')})", PORT)],
                           mappings=up_down_mappings(), thresholds=[{"color": "red", "value": None},
                                                                    {"color": "green", "value": 1}]),
            timeseries("Port rate", "The rate each port trained at (a drop is a degraded link).",
                       [target(f"max by (node, device, port) ({sel('healthagent_infiniband_rate_bytes_per_second')})",
                               PORT)], unit="Bps", step=True),
        ]),
        (8, [
            timeseries("Throughput per port", "Octets sent and received per second.",
                       [per_port("rate", "port_data_transmitted_bytes_total", PORT + " tx"),
                        per_port("rate", "port_data_received_bytes_total", PORT + " rx")], unit="Bps"),
            timeseries("Link flaps and errors", "link_downed (flaps), symbol errors and receive errors per interval.",
                       [per_port("increase", "link_downed_total", PORT + " link downed"),
                        per_port("increase", "symbol_error_total", PORT + " symbol errors"),
                        per_port("increase", "port_errors_received_total", PORT + " rcv errors")], bars=True),
            timeseries("Congestion", "Transmit wait ticks, and on RoCE ports the CNPs sent and handled: the "
                       "fabric's and the job's business, shown, never judged.",
                       [per_port("rate", "port_transmit_wait_total", PORT + " xmit wait"),
                        per_port("rate", "np_cnp_packets_sent_total", PORT + " CNPs sent"),
                        per_port("rate", "rp_cnp_packets_handled_total", PORT + " CNPs handled")]),
        ]),
        (8, [
            timeseries("ConnectX adapter events", "ConnectX (mlx5_core) kernel-log events per interval, by node, "
                       "adapter (RDMA device and PCI id) and event (docs/findings.md#rdma_adapter_event); an "
                       "adapter's first events of a boot included.",
                       [target(adapter_events_per_interval(), ADAPTER)], bars=True),
            table("Nodes with a fatal adapter event", "Adapters that logged, in this boot, an event that takes "
                  "the node out (the reboot_node events of the mlx5 catalog, those HealthagentRdmaAdapterFatal "
                  "fires on), and how many times. The node stays listed until it reboots.",
                  [target(f"max by (node, device, pci_bus_id, event) "
                          f"({sel('healthagent_mlx5_events_total', FATAL)}) > 0", instant=True, table=True)],
                  sort_by="Value"),
        ]),
    ],
)
