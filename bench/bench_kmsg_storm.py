"""Kernel-log storm: how fast the XID parser reads, and the agent under a 1,000,000-line flood.

    .venv/bin/python -m bench.bench_kmsg_storm [--lines 1000000] [--xid-every 1000] [--runs 5]

Three figures (the flood is ``tests/support/floods.py``: /dev/kmsg records, ordinary noise with an
XID record every ``--xid-every`` lines, eight different XIDs on the eight GPUs):

1. ``iter_events`` (what ``healthagent classify`` uses) over the flood in memory, as /dev/kmsg
   records and as ``dmesg`` lines: lines per second, median of ``--runs``; every XID found;
2. ``KmsgSource.collect`` following the demo node's kernel log (a regular file, read in 1 MiB
   chunks, ``max_records_per_cycle`` as configured) after the flood was appended: collect until it
   is caught up; lines per second, median of ``--runs``; every XID found;
3. the agent (``healthagent run --kube dry-run`` on the demo node, default settings) while the flood
   is appended to its kernel log as fast as this script can write it: time until
   ``healthagent_xid_errors_total`` counts every XID (from the start and from the end of the flood),
   peak RSS (VmHWM) before and after, RSS after, and no XID missed or counted twice.
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import tempfile
import time
from pathlib import Path

from bench.common import machine, median, mib, table
from tests.support.floods import append_flood, flood_records
from tests.support.live_agent import AgentProcess, wait_until

_KMSG_TEXT = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")


def as_dmesg(records: list[str]) -> list[str]:
    """The same flood as ``dmesg`` prints it: ``[seconds.micro] text``."""
    out = []
    for record in records:
        match = _KMSG_TEXT.match(record.rstrip("\n"))
        usec, text = int(match.group(1)), match.group(2)
        out.append(f"[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] {text}\n")
    return out


def parse_rate(lines: list[str], expected: int, runs: int) -> float:
    from healthagent.sources.kmsg import iter_events

    rates = []
    for _ in range(runs):
        started = time.perf_counter()
        found = sum(1 for _ in iter_events(io.StringIO("".join(lines)), time.time(), host_root="/nonexistent"))
        rates.append(len(lines) / (time.perf_counter() - started))
        if found != expected:
            raise SystemExit(f"iter_events found {found} XIDs, the flood holds {expected}")
    return median(rates)


def follow_rate(lines: int, xid_every: int, runs: int, tmp: Path) -> tuple[float, int, int]:
    """(lines/s, collects needed, XIDs found) of KmsgSource following the demo node's log."""
    from healthagent.config import Settings
    from healthagent.demo.node import build_demo_root
    from healthagent.sources.kmsg import KmsgSource

    rates, collects, found = [], 0, 0
    for run in range(runs):
        demo = build_demo_root(tmp / f"follow-{run}")
        source = KmsgSource(str(demo.root), str(demo.kernel_log),
                            max_records_per_cycle=Settings().kmsg_max_records_per_cycle)
        source.collect(time.time())  # the boot log
        flood = append_flood(demo.kernel_log, demo.gpu_pci_bus_ids, lines, xid_every)
        started = time.perf_counter()
        found, collects = 0, 0
        while True:
            result = source.collect(time.time())
            collects += 1
            found += len(result.xids)
            if source.cursor.offset >= demo.kernel_log.stat().st_size:
                break
        rates.append(lines / (time.perf_counter() - started))
        source.close()
        if found != flood.xids:
            raise SystemExit(f"KmsgSource found {found} XIDs, the flood holds {flood.xids}")
    return median(rates), collects, found


def agent_flood(lines: int, xid_every: int, tmp: Path) -> dict:
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import stub_nvml_env

    demo = build_demo_root(tmp / "agent-root")
    agent = AgentProcess(dict(host_root=demo.root, kube="dry-run", node_name="demo-p5-node", listen="127.0.0.1:0",
                              state_file=tmp / "agent-state.json", expected_gpus=8, expected_efa_devices=32,
                              log_level="WARNING"),
                         tmp / "agent.log", env=stub_nvml_env(demo.scenario, tmp / "cache" / "healthagent"))
    try:
        agent.wait_metric(lambda s: s.value("healthagent_efa_devices") == 32, what="the agent's first cycle")
        before_peak, before_rss = agent.hwm_kib(), agent.rss_kib()
        started = time.monotonic()
        flood = append_flood(demo.kernel_log, demo.gpu_pci_bus_ids, lines, xid_every)
        written = time.monotonic()
        scrape = agent.wait_metric(lambda s: s.total("healthagent_xid_errors_total") >= flood.xids,
                                   timeout=600, what="every XID counted")
        caught_up = time.monotonic()
        counted = {int(s.labels["xid"]): s.value for s in scrape.samples if s.name == "healthagent_xid_errors_total"}
        by_xid = {}
        for xid, value in counted.items():
            by_xid[xid] = by_xid.get(xid, 0) + value
        wait_until(lambda: agent.proc.poll() is None, what="the agent still running")
        return {"written_s": written - started, "caught_up_s": caught_up - started,
                "after_end_s": caught_up - written, "peak_before": before_peak, "peak_after": agent.hwm_kib(),
                "rss_before": before_rss, "rss_after": agent.rss_kib(), "expected": flood.by_xid,
                "counted": by_xid, "file_mib": demo.kernel_log.stat().st_size / 2**20}
    finally:
        agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--xid-every", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"kernel-log storm, {args.lines:,} lines, an XID every {args.xid_every}; {machine()}")
    records, expected = [], 0
    pci = ["0000:53:00.0", "0000:64:00.0", "0000:75:00.0", "0000:86:00.0"]
    for record, xid in flood_records(0, args.lines, args.xid_every, pci):
        records.append(record)
        expected += xid is not None
    rows = [["iter_events, /dev/kmsg records", f"{parse_rate(records, expected, args.runs):,.0f}", expected],
            ["iter_events, dmesg lines", f"{parse_rate(as_dmesg(records), expected, args.runs):,.0f}", expected]]
    del records
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
        rate, collects, found = follow_rate(args.lines, args.xid_every, max(1, args.runs // 2), Path(tmp))
        rows.append([f"KmsgSource.collect following a file ({collects} collects)", f"{rate:,.0f}", found])
        print(table(["parser", "lines/s (median)", "XIDs found"], rows))
        got = agent_flood(args.lines, args.xid_every, Path(tmp))
    missed = {x: n - got["counted"].get(x, 0) for x, n in got["expected"].items() if got["counted"].get(x, 0) != n}
    print(f"\nthe agent under the flood ({got['file_mib']:.0f} MiB of kernel log, "
          f"{sum(got['expected'].values())} XIDs)")
    print(table(["figure", "value"], [
        ["flood written in", f"{got['written_s']:.1f} s"],
        ["every XID counted after the flood began", f"{got['caught_up_s']:.1f} s"],
        ["  after the flood was written", f"{got['after_end_s']:.1f} s"],
        ["peak RSS before / after", f"{mib(got['peak_before'])} / {mib(got['peak_after'])}"],
        ["RSS before / after", f"{mib(got['rss_before'])} / {mib(got['rss_after'])}"],
        ["XIDs missed or counted twice (by XID)", missed or "none"],
    ]))


if __name__ == "__main__":
    main()
