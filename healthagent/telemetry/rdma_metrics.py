"""InfiniBand and RoCE port metrics, named as node_exporter's infiniband collector names them.

Why node_exporter's names: fleets already chart ``node_infiniband_*``; with the same names under
the agent's prefix (``healthagent_infiniband_port_data_transmitted_bytes_total`` beside
``node_infiniband_port_data_transmitted_bytes_total``), the same labels (``device``, ``port``) and
the same values, a query moves from one to the other by its prefix. The values follow
node_exporter exactly (a test runs both on one tree and compares every series they share):

- the data counters (``port_xmit_data``, ``port_rcv_data``, and ``*_data_64`` of ``counters_ext/``)
  count 4-octet words in sysfs; node_exporter multiplies them by 4 into octets, and so does this;
- ``rate`` ``"400 Gb/sec (4X NDR)"`` is ``rate_bytes_per_second`` 5e10: the number parsed as a
  32-bit float (as Go's ``ParseFloat(s, 32)``) times 125,000,000, truncated to an integer;
- ``state_id``/``physical_state_id`` are the numbers before the colon.

Driver counters (``hw_counters/``) carry the names node_exporter gives them since it reads them
(``out_of_buffer`` -> ``out_of_buffer_drops_total``); one it has no name for is exported as
``healthagent_infiniband_hw_<file>_total``, so whatever the driver exposes is there. The agent's
own: ``port_up`` (what the port-down rule reads), ``port_info`` (link layer, netdev, PCI id) and
``port_gpu_info`` (the GPUs behind the port's PCIe switch).

Rendering is pure (the snapshot's ports), and each family is keyed by the values it is built
from, so a scrape re-encodes only the families whose values moved.

Device and port names come from sysfs, so their series are bounded as every untrusted name is
(``healthagent/bounded_names.py``): the first ``RDMA_PORTS`` ports in (device, port) order keep
their labels; the rest fold into ``device="~other", port="~other"``, whose counters are their sum
and whose ``port_up`` is 1 only while every one of them is up. ``ports_folded`` says how many.
"""

from __future__ import annotations

import re
import struct
from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from healthagent.bounded_names import OVERFLOW, RDMA_PORTS, keep_first
from healthagent.model import RdmaPort
from healthagent.telemetry.encode_cache import FamilyInput
from healthagent.telemetry.spec import PREFIX, MetricSpec

NS = PREFIX + "infiniband_"
LABELS = ("device", "port")
OCTETS_PER_WORD = 4

# counters/ and counters_ext/ file -> node_exporter's name (without its prefix).
PMA_NAMES: dict[str, str] = {
    "excessive_buffer_overrun_errors": "excessive_buffer_overrun_errors_total",
    "link_downed": "link_downed_total",
    "link_error_recovery": "link_error_recovery_total",
    "local_link_integrity_errors": "local_link_integrity_errors_total",
    "multicast_rcv_packets": "multicast_packets_received_total",
    "multicast_xmit_packets": "multicast_packets_transmitted_total",
    "port_rcv_constraint_errors": "port_constraint_errors_received_total",
    "port_rcv_data": "port_data_received_bytes_total",
    "port_rcv_discards": "port_discards_received_total",
    "port_rcv_errors": "port_errors_received_total",
    "port_rcv_packets": "port_packets_received_total",
    "port_rcv_remote_physical_errors": "port_receive_remote_physical_errors_total",
    "port_rcv_switch_relay_errors": "port_receive_switch_relay_errors_total",
    "port_xmit_constraint_errors": "port_constraint_errors_transmitted_total",
    "port_xmit_data": "port_data_transmitted_bytes_total",
    "port_xmit_discards": "port_discards_transmitted_total",
    "port_xmit_packets": "port_packets_transmitted_total",
    "port_xmit_wait": "port_transmit_wait_total",
    "symbol_error": "symbol_error_total",
    "unicast_rcv_packets": "unicast_packets_received_total",
    "unicast_xmit_packets": "unicast_packets_transmitted_total",
    "VL15_dropped": "vl15_dropped_total",
    "port_multicast_rcv_packets": "legacy_multicast_packets_received_total",
    "port_multicast_xmit_packets": "legacy_multicast_packets_transmitted_total",
    "port_rcv_data_64": "legacy_data_received_bytes_total",
    "port_rcv_packets_64": "legacy_packets_received_total",
    "port_unicast_rcv_packets": "legacy_unicast_packets_received_total",
    "port_unicast_xmit_packets": "legacy_unicast_packets_transmitted_total",
    "port_xmit_data_64": "legacy_data_transmitted_bytes_total",
    "port_xmit_packets_64": "legacy_packets_transmitted_total",
}
WORD_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data", "port_rcv_data_64", "port_xmit_data_64"})
# hw_counters/ file -> node_exporter's name.
HW_NAMES: dict[str, str] = {
    "duplicate_request": "duplicate_requests_packets_total",
    "implied_nak_seq_err": "implied_nak_seq_errors_total",
    "local_ack_timeout_err": "local_ack_timeout_errors_total",
    "np_cnp_sent": "np_cnp_packets_sent_total",
    "np_ecn_marked_roce_packets": "np_ecn_marked_roce_packets_received_total",
    "out_of_buffer": "out_of_buffer_drops_total",
    "out_of_sequence": "out_of_sequence_packets_received_total",
    "packet_seq_err": "packet_sequence_errors_total",
    "req_cqe_error": "req_cqes_errors_total",
    "req_cqe_flush_error": "req_cqes_flush_errors_total",
    "req_remote_access_errors": "req_remote_access_errors_total",
    "req_remote_invalid_request": "req_remote_invalid_request_errors_total",
    "resp_cqe_error": "resp_cqes_errors_total",
    "resp_cqe_flush_error": "resp_cqes_flush_errors_total",
    "resp_local_length_error": "resp_local_length_errors_total",
    "resp_remote_access_errors": "resp_remote_access_errors_total",
    "rnr_nak_retry_err": "rnr_nak_retry_packets_received_total",
    "roce_adp_retrans": "roce_adp_retransmits_total",
    "roce_adp_retrans_to": "roce_adp_retransmits_timeout_total",
    "roce_slow_restart": "roce_slow_restart_used_total",
    "roce_slow_restart_cnps": "roce_slow_restart_cnps_total",
    "roce_slow_restart_trans": "roce_slow_restart_total",
    "rp_cnp_handled": "rp_cnp_packets_handled_total",
    "rp_cnp_ignored": "rp_cnp_ignored_packets_received_total",
    "rx_atomic_requests": "rx_atomic_requests_total",
    "rx_dct_connect": "rx_dct_connect_requests_total",
    "rx_read_requests": "rx_read_requests_total",
    "rx_write_requests": "rx_write_requests_total",
    "rx_icrc_encapsulated": "rx_icrc_encapsulated_errors_total",
}
_UNSAFE = re.compile(r"[^a-z0-9_]+")
COUNTER_HELP = "InfiniBand/RoCE counter {file} (cumulative; data counters in octets)."


def _spec(name: str, kind: str, labels: str, text: str) -> MetricSpec:
    return MetricSpec("infiniband_" + name, kind, tuple(labels.split()), text)


# The fixed families (the counters' families follow their files: docs/reference/metrics.md lists them).
RDMA: tuple[MetricSpec, ...] = (
    _spec("info", "gauge", "device board_id firmware_version hca_type",
          "1 for every InfiniBand/RoCE device the agent reads (as node_exporter's)."),
    _spec("state_id", "gauge", "device port",
          "Port state (0: no change, 1: down, 2: init, 3: armed, 4: active, 5: act defer)."),
    _spec("physical_state_id", "gauge", "device port",
          "Physical port state (1: sleep, 2: polling, 3: disabled, 4: shift, 5: link up, 6: link error "
          "recovery, 7: phytest)."),
    _spec("rate_bytes_per_second", "gauge", "device port", "The port's signalling rate, in bytes a second."),
    _spec("port_up", "gauge", "device port",
          "1 while the port is ACTIVE and its link up (what the port-down rule reads), 0 otherwise."),
    _spec("port_info", "gauge", "device port link_layer netdev pci_bus_id",
          "1 for every port; link_layer InfiniBand or Ethernet (RoCE), its network interface and PCI id."),
    _spec("port_gpu_info", "gauge", "device port pci_bus_id",
          "1 for each GPU (pci_bus_id) behind the same PCIe switch as the port."),
    _spec("ports_folded", "gauge", "",
          "Ports past the bound on sysfs names, exported together as device=port=\"~other\"."),
)
_BY_NAME = {spec.name[len("infiniband_"):]: spec for spec in RDMA}


def go_rate_bytes(rate_gbps: float) -> int:
    """node_exporter's bytes a second for a rate in Gb/s: float32 parse, x 125e6, truncated."""
    as_float32 = struct.unpack("f", struct.pack("f", rate_gbps))[0]
    return int(as_float32 * 125_000_000)


def counter_name(file: str, hw: bool) -> str:
    """The family of a counter file (full name)."""
    known = (HW_NAMES if hw else PMA_NAMES).get(file)
    if known is not None:
        return NS + known
    base = _UNSAFE.sub("_", file.lower()).strip("_")
    return f"{NS}hw_{base}_total" if hw else f"{NS}{base}_total"


def _value(file: str, value: int) -> float:
    return float(value * OCTETS_PER_WORD if file in WORD_COUNTERS else value)


def _columns(ports: tuple[RdmaPort, ...], folded: tuple[RdmaPort, ...] = ()) -> dict[str, tuple[str, list]]:
    """family -> (the first file it comes from, [((device, port), value), ...]); the ``folded``
    ports' values summed under the overflow labels, last."""
    columns: dict[str, tuple[str, list]] = {}
    for port in ports:
        labels = (port.device, str(port.port))
        for hw, counters in ((False, port.counters), (True, port.hw_counters)):
            for file in sorted(counters):
                name = counter_name(file, hw)
                column = columns.setdefault(name, (file, []))
                if not column[1] or column[1][-1][0] != labels:  # one value per port and family
                    column[1].append((labels, _value(file, counters[file])))
    sums: dict[str, tuple[str, float]] = {}
    for port in folded:
        for hw, counters in ((False, port.counters), (True, port.hw_counters)):
            for file in counters:
                name = counter_name(file, hw)
                first, total = sums.get(name, (file, 0.0))
                sums[name] = (first, total + _value(file, counters[file]))
    for name in sorted(sums):
        file, total = sums[name]
        columns.setdefault(name, (file, []))[1].append(((OVERFLOW, OVERFLOW), total))
    return columns


def _counter(name: str, file: str, rows: tuple) -> Metric:
    family = CounterMetricFamily(name, COUNTER_HELP.format(file=file), labels=list(LABELS))
    for labels, value in rows:
        family.add_metric(list(labels), value)
    return family


def _gauge(name: str, rows: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    spec = _BY_NAME[name]
    family = GaugeMetricFamily(spec.full_name, spec.help, labels=list(spec.labels))
    for labels, value in rows:
        family.add_metric(list(labels), value)
    return family


def _gauge_rows(ports: tuple[RdmaPort, ...], folded: tuple[RdmaPort, ...] = ()) -> dict[str, tuple]:
    devices = {p.device: p for p in ports}
    key = [(p.device, str(p.port)) for p in ports]
    overflow_up = (((OVERFLOW, OVERFLOW), 1.0 if all(p.up for p in folded) else 0.0),) if folded else ()
    return {
        "info": tuple(((d.device, d.board_id, d.fw_ver, d.hca_type), 1.0) for d in devices.values()),
        "state_id": tuple((k, float(p.state_id)) for k, p in zip(key, ports)),
        "physical_state_id": tuple((k, float(p.phys_state_id)) for k, p in zip(key, ports)),
        "rate_bytes_per_second": tuple((k, float(go_rate_bytes(p.rate_gbps))) for k, p in zip(key, ports)
                                       if p.rate_gbps is not None),
        "port_up": tuple((k, 1.0 if p.up else 0.0) for k, p in zip(key, ports)) + overflow_up,
        "port_info": tuple(((*k, p.link_layer, p.netdev, p.pci_bus_id), 1.0) for k, p in zip(key, ports)),
        "port_gpu_info": tuple(((*k, gpu), 1.0) for k, p in zip(key, ports) for gpu in p.gpus),
        "ports_folded": (((), float(len(folded))),),
    }


def rdma_family_inputs(ports: tuple[RdmaPort, ...]) -> Iterator[FamilyInput]:
    """Every RDMA family with the values it is built from (nothing on a node without ports)."""
    if not ports:
        return
    kept, rest = keep_first(sorted(ports, key=lambda p: (p.device, p.port)), RDMA_PORTS)
    ports, folded = tuple(kept), tuple(rest)
    for name, rows in _gauge_rows(ports, folded).items():
        yield FamilyInput(_BY_NAME[name].full_name, rows, lambda name=name, rows=rows: _gauge(name, rows))
    columns = _columns(ports, folded)
    for name in sorted(columns):
        file, rows = columns[name][0], tuple(columns[name][1])
        yield FamilyInput(name, rows, lambda name=name, file=file, rows=rows: _counter(name, file, rows))


def rdma_families(ports: tuple[RdmaPort, ...]) -> Iterator[Metric]:
    for family in rdma_family_inputs(ports):
        yield family.build()
