"""A 1,000,000-line kernel-log flood with XIDs sprinkled in, appended to a running agent's log.

The agent is the real ``healthagent run`` in a subprocess (its memory is its own, read from
/proc), on the demo node, writing to the fake API server. The flood (``tests/support/floods.py``)
is about 120 MB of /dev/kmsg records; the agent must read it in bounded pieces (its peak RSS grows
by far less than the flood's size), count every XID exactly once, and taint once.
"""

from __future__ import annotations

import pytest

from tests.reliability.helpers import NODE, events_by_reason, our_taints
from tests.support.floods import append_flood, warm_flood_agent
from tests.support.live_agent import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

LINES = 1_000_000
XID_EVERY = 10_000
PEAK_GROWTH_LIMIT_KIB = 64 * 1024  # the flood is ~118 MiB: a reader that slurped it would pass this


def test_a_million_line_flood(demo, fake, tmp_path, stub_cache):
    agent = warm_flood_agent(demo, fake.url, NODE, tmp_path, stub_cache)
    try:
        peak_before = agent.hwm_kib()
        flood = append_flood(demo.kernel_log, demo.gpu_pci_bus_ids, LINES, XID_EVERY)
        assert flood.xids == LINES // XID_EVERY
        size_kib = demo.kernel_log.stat().st_size // 1024
        done = agent.wait_metric(lambda s: s.total("healthagent_xid_errors_total") >= flood.xids,
                                 timeout=300, what="every XID of the flood counted")
        counted = {}
        for sample in done.samples:
            if sample.name == "healthagent_xid_errors_total":
                counted[int(sample.labels["xid"])] = counted.get(int(sample.labels["xid"]), 0) + sample.value
        assert counted == flood.by_xid  # none missed, none counted twice
        growth = agent.hwm_kib() - peak_before
        assert growth < PEAK_GROWTH_LIMIT_KIB < size_kib, (growth, size_kib)
        assert done.value("healthagent_source_up", source="kmsg") == 1
        assert done.value("healthagent_node_action", action="replace_node") == 1
        wait_until(lambda: our_taints(fake) == [("replace_node", "NoSchedule")], what="the taint")
        open_incidents = done.value("healthagent_findings", code="GPU_XID", action="replace_node") or 0
        wait_until(lambda: events_by_reason(fake).get("GPU_XID", 0) >= 1, what="the Events")
        agent.wait_metric(lambda s: s.value("healthagent_kube_pending_writes") == 0, what="all written")
        incidents = sum(s.value for s in agent.scrape().samples
                        if s.name == "healthagent_findings" and s.labels["code"] == "GPU_XID")
        assert open_incidents >= 1
        assert events_by_reason(fake) == {"GPU_XID": incidents}  # one Event per incident, no repeats
        assert agent.proc.poll() is None
    finally:
        agent.close()
