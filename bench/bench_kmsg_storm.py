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
   peak RSS (VmHWM) before and after, RSS after, and no XID missed or counted twice;
4. the agent under a storm of one XID (``--storm-lines`` XID 13 records on one GPU, then one XID
   94 on it, ``tests/support/floods.py``'s ``append_xid_storm``): time from the 94 being written
   to its finding (``GPU_XID`` at ``replace_node`` in /metrics, polled every 20 ms), peak RSS and
   RSS before and after, the longest line the agent logged (at INFO), and the XIDs counted.
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
from tests.support.floods import append_flood, append_xid_storm, flood_records
from tests.support.live_agent import AgentProcess, scrape_or_none, wait_until

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
    from healthagent.sources.kernel_log.offline import iter_events

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
    from healthagent.sources.kernel_log.source import KmsgSource

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


def demo_agent(tmp: Path, name: str, log_level: str):
    """(the demo node, ``healthagent run --kube dry-run`` on it after its first cycle)."""
    from healthagent.demo.node import build_demo_root
    from healthagent.demo.stub_setup import stub_nvml_env

    demo = build_demo_root(tmp / f"{name}-root")
    agent = AgentProcess(dict(host_root=demo.root, kube="dry-run", node_name="demo-p5-node", listen="127.0.0.1:0",
                              state_file=tmp / f"{name}-state.json", expected_gpus=8, expected_efa_devices=32,
                              log_level=log_level),
                         tmp / f"{name}.log", env=stub_nvml_env(demo.scenario, tmp / "cache" / "healthagent"))
    try:
        agent.wait_metric(lambda s: s.value("healthagent_efa_devices") == 32, what="the agent's first cycle")
    except BaseException:
        agent.close()
        raise
    return demo, agent


def agent_flood(lines: int, xid_every: int, tmp: Path) -> dict:
    demo, agent = demo_agent(tmp, "agent", "WARNING")
    try:
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


def agent_storm(lines: int, tmp: Path) -> dict:
    """The agent while ``lines`` XID 13s and then one XID 94 are appended to its kernel log."""
    demo, agent = demo_agent(tmp, "storm", "INFO")
    try:
        before_peak, before_rss = agent.hwm_kib(), agent.rss_kib()
        started = time.monotonic()
        flood = append_xid_storm(demo.kernel_log, demo.gpu_pci_bus_ids[2], xid=13, lines=lines, then=94)
        written = time.monotonic()
        scrape = wait_until(lambda: _acted_on_94(agent), 600, "the XID 94 acted on", interval=0.02)
        acted = time.monotonic()
        done = agent.wait_metric(lambda s: s.total("healthagent_xid_errors_total") >= flood.xids, timeout=600,
                                 what="every XID counted")
        counted = {int(s.labels["xid"]): int(s.value) for s in done.samples
                   if s.name == "healthagent_xid_errors_total"}
        time.sleep(2.0)  # let the agent settle before the last RSS reading
        return {"written_s": written - started, "acted_after_written_s": acted - written,
                "acted_after_start_s": acted - started, "peak_before": before_peak, "peak_after": agent.hwm_kib(),
                "rss_before": before_rss, "rss_after": agent.rss_kib(), "expected": flood.by_xid,
                "counted": counted, "longest_log_line": max(len(line) for line in agent.log().splitlines()),
                "file_mib": demo.kernel_log.stat().st_size / 2**20, "seen_before_94": scrape is not None}
    finally:
        agent.close()


def _acted_on_94(agent: AgentProcess):
    scrape = scrape_or_none(agent.port)
    return scrape if scrape is not None and scrape.value("healthagent_findings", code="GPU_XID",
                                                         action="replace_node") else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--xid-every", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--storm-lines", type=int, default=1_000_000,
                        help="XID 13 records before the XID 94 in the one-XID storm (0: skip it)")
    parser.add_argument("--only-storm", action="store_true", help="run the one-XID storm only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.only_storm:
        with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
            print_storm(agent_storm(args.storm_lines, Path(tmp)), args.storm_lines)
        return
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
    if args.storm_lines:
        with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
            print_storm(agent_storm(args.storm_lines, Path(tmp)), args.storm_lines)


def print_storm(got: dict, lines: int) -> None:
    print(f"\nthe agent under a storm of one XID ({lines:,} XID 13 records on one GPU, then one XID 94; "
          f"{got['file_mib']:.0f} MiB of kernel log); {machine()}")
    print(table(["figure", "value"], [
        ["storm written in", f"{got['written_s']:.1f} s"],
        ["XID 94 acted on (GPU_XID replace_node) after it was written", f"{got['acted_after_written_s']:.2f} s"],
        ["  after the storm began", f"{got['acted_after_start_s']:.1f} s"],
        ["peak RSS before / after", f"{mib(got['peak_before'])} / {mib(got['peak_after'])}"],
        ["RSS before / after", f"{mib(got['rss_before'])} / {mib(got['rss_after'])}"],
        ["longest log line (INFO)", f"{got['longest_log_line']} characters"],
        ["XIDs counted / written", f"{got['counted']} / {got['expected']}"],
    ]))


if __name__ == "__main__":
    main()
