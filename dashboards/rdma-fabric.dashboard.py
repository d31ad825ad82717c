"""InfiniBand and RoCE fabric: each port's state, rate, traffic, link flaps, errors and congestion.

Counters carry node_exporter's infiniband names under the agent's prefix (docs/metrics.md), with
the labels ``device`` and ``port``; every one is cumulative, so panels show rates or per-interval
increases. Unlike EFA, a port's state is real here: "Port state" shows a link that is down.
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
    target,
    timeseries,
    up_down_mappings,
)

PORT = "{{node}} {{device}}/{{port}}"
RDMA_CODES = 'code=~"RDMA_.*"'


def per_port(function: str, counter: str, legend: str = PORT) -> object:
    """``function`` (rate or increase) of one ``healthagent_infiniband_<counter>`` per node and port."""
    return target(f"sum by (node, device, port) ({function}({sel(f'healthagent_infiniband_{counter}')}{RATE}))",
                  legend)


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
    ],
)
