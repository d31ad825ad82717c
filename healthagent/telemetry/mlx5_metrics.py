"""``healthagent_mlx5_events_total``: ConnectX (mlx5) kernel-log events by adapter and event.

The tally is the loop's (``agent.AdapterTally``: what the classifier judged, this boot's events,
each with the RDMA device its PCI id matched, folded floods by their full count); the family is
rendered from the snapshot like every other. A node without InfiniBand/RoCE ports and without any mlx5
event exports no family at all, as it exports no ``healthagent_infiniband_*`` family: a GPU node
with EFA only has nothing to say here.

Labels: ``device`` (``mlx5_0``; "" when no port the RDMA source read has that PCI id),
``pci_bus_id`` (canonical) and ``event`` (a row of ``policy/mlx5_events.csv``). The set is small
and fixed per node: adapters times the events they logged.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import Metric

from healthagent.model import AgentSnapshot
from healthagent.telemetry import spec as names

SPEC = names.by_name(names.HEALTH)["mlx5_events_total"]


def mlx5_families(snapshot: AgentSnapshot) -> Iterator[Metric]:
    """The counter, when the node has RDMA ports or has counted an mlx5 event; else nothing."""
    if not snapshot.rdma and not snapshot.adapter_counts:
        return
    totals: dict[tuple[str, str, str], int] = {}
    for count in snapshot.adapter_counts:
        key = (count.device, count.pci_bus_id, count.event)
        totals[key] = totals.get(key, 0) + count.count
    family = SPEC.family()
    for labels in sorted(totals):
        family.add_metric(list(labels), float(totals[labels]))
    yield family
