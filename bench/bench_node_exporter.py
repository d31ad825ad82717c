"""Side by side with node_exporter's infiniband collector on the same EFA sysfs tree.

    .venv/bin/python -m bench.bench_node_exporter [--scrapes 200]

Needs Debian's ``prometheus-node-exporter`` (1.5.0 here) at /usr/bin. It runs with only its
infiniband collector (``--collector.disable-defaults --collector.infiniband``) and
``--path.sysfs=<demo root>/sys``; the agent runs as ``healthagent run --no-nvml --kube dry-run``
on the same demo root (its EFA part is what is compared; NVML off also keeps the stub library's
polling out of the CPU figure).

First it shows what node_exporter makes of the demo tree as written: its collector needs, per
device, ``board_id`` and ``fw_ver`` and, per port, ``rate`` and a ``counters/`` directory (the IB
PMA counters), and never opens ``hw_counters/``. The demo tree has only what the EFA source reads,
so the bench then adds those generic ib_core files (``board_id``/``fw_ver`` empty, ``rate``
"100 Gb/sec (4X EDR)", ``counters/`` empty) and shows what node_exporter exports from the result.

Then, in one run, it scrapes both ``--scrapes`` times, alternating, with the headers Prometheus
sends (OpenMetrics preferred, gzip). A real scrape (every 15-30 s) always finds the agent with
counters newer than at the last scrape (it collects every 10 s), and the agent re-encodes only the
parts of its snapshot that changed; so here the agent collects EFA every 1 s, the traffic counters
move before every scrape and the scrapes are 1.1 s apart: every agent scrape encodes the EFA part
afresh, as in production. Per scrape it reports: the CPU time each process spent (from /proc;
the agent's background loop, with its 1 s EFA collections, is subtracted: rounds with and
without a scrape alternate, each 1.1 s with the same counter moves), the bytes on the wire and
uncompressed, the series, and the ratios.
node_exporter reads sysfs on every scrape; the agent reads it on its own 10 s loop and renders a
snapshot per scrape, so its collection cost per 10 s (``healthagent_collect_duration_seconds``
for ``efa``) is printed beside it.

A per-counter comparison puts both on the same footing: each reading sysfs once per scrape. For
the agent that is a scrape plus one whole collection cycle (the CPU of the rounds without a scrape
divided by the collections in them: EFA, the kernel log, classification, the snapshot); for
node_exporter its scrape. Each is divided by the sysfs files it reads (node_exporter's counted
with ``strace`` over one scrape, where strace is installed; the agent's are the files its EFA source
reads per collection, counted in the tree) and by the series it exports. On this demo tree of
regular files the agent opens and closes each file, as node_exporter does; on a node's real sysfs
it holds them open and reads each with one ``pread``, which the first figure printed measures on
this machine's own kernfs attributes.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import PROMETHEUS_ACCEPT, machine, table
from tests.support.live_agent import AgentProcess, Scrape, free_port, proc_cpu_seconds, wait_until

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
EFA_INTERVAL_SECONDS = 1.0  # the agent's EFA collection in this bench (default 10 s), see below
GAP_SECONDS = 1.1


def fetch(port: int) -> tuple[bytes, bytes]:
    """(bytes on the wire, uncompressed body) of one scrape as Prometheus makes it."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        wire = reply.read()
        encoded = reply.headers.get("Content-Encoding") == "gzip"
    return wire, gzip.decompress(wire) if encoded else wire


class NodeExporter:
    def __init__(self, sysfs: Path, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [NODE_EXPORTER, f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.infiniband",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._answers, 30, "node_exporter to listen")

    def _answers(self) -> bool:
        try:
            fetch(self.port)
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()


def add_ib_core_files(root: Path) -> None:
    """The generic files ib_core gives every RDMA device that node_exporter's collector requires."""
    for link in sorted((root / "sys" / "class" / "infiniband").iterdir()):
        device = link.resolve()
        (device / "board_id").write_text("\n")
        (device / "fw_ver").write_text("\n")
        for port in (device / "ports").iterdir():
            (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
            (port / "counters").mkdir(exist_ok=True)


def files_opened_per_scrape(exporter: NodeExporter, sysfs: Path) -> int | None:
    """The files under ``sysfs`` node_exporter opens during one scrape (strace on every thread);
    None without strace."""
    if shutil.which("strace") is None:
        return None
    with tempfile.TemporaryDirectory(prefix="ne-strace-") as tmp:
        out = Path(tmp) / "trace"
        threads = [f"-p{tid}" for tid in os.listdir(f"/proc/{exporter.proc.pid}/task")]
        tracer = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(out), *threads],
                                  stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
        fetch(exporter.port)
        time.sleep(0.5)
        tracer.terminate()
        tracer.wait(10)
        opened = [line for line in out.read_text().splitlines()
                  if str(sysfs) in line and "O_DIRECTORY" not in line and "= -1" not in line]
    return len(opened)


def efa_files_per_collection(sysfs: Path) -> int:
    """The files the agent's EFA source reads per collection: every counter file of each device's
    ``hw_counters`` and ``ports/1/hw_counters`` (``lifespan`` is a setting, not a counter) and each
    port's ``state`` and ``phys_state``."""
    count = 0
    for device in (sysfs / "class" / "infiniband").iterdir():
        for directory in (device / "hw_counters", device / "ports" / "1" / "hw_counters"):
            if directory.is_dir():
                count += sum(1 for f in directory.iterdir() if f.name != "lifespan")
        count += sum(1 for name in ("state", "phys_state") if (device / "ports" / "1" / name).exists())
    return count


def kernfs_reads(files: int = 1216, rounds: int = 30) -> tuple[float, float] | None:
    """On this machine's real sysfs (kernfs): CPU per round of ``files`` small attribute reads, the
    EFA source's way before (open, read, close each) and now (``HeldFiles``: one pread each), as
    (before, now) seconds, the median of ``rounds``. The network interfaces' statistics stand in
    for EFA counters (no EFA device here): the same kind of kernfs attribute. None without them."""
    import glob
    import statistics

    from healthagent.sources.efa import READ_LIMIT
    from healthagent.sources.sysfs_files import HeldFiles, read_once

    found = sorted(glob.glob("/sys/class/net/*/statistics/*"))
    if not found:
        return None
    paths = (found * (files // len(found) + 1))[:files]
    held = HeldFiles("bench")
    timings: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(rounds):
        for name, read in (("before", lambda p: read_once(p, READ_LIMIT)), ("now", lambda p: held.read(p, READ_LIMIT))):
            started = time.process_time()
            for path in paths:
                read(path)
            timings[name].append(time.process_time() - started)
    held.close()
    return statistics.median(timings["before"]), statistics.median(timings["now"])


def traffic(demo, step: int) -> None:
    """Traffic counters move on every device, as under a training job."""
    for device in demo.efa_devices:
        demo.bump_efa_counter(device, "tx_bytes", 2_700_000_000 + step)


def exported(body: bytes, prefix: str) -> dict[str, int]:
    """Series count per metric family name under ``prefix``."""
    counts: dict[str, int] = {}
    for sample in Scrape(body.decode()).samples:
        if sample.name.startswith(prefix):
            counts[sample.name] = counts.get(sample.name, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if shutil.which(NODE_EXPORTER) is None:
        raise SystemExit("prometheus-node-exporter not installed (apt-get install prometheus-node-exporter)")
    version = subprocess.run([NODE_EXPORTER, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    print(f"{version}; {machine()}")
    kernfs = kernfs_reads()
    if kernfs is not None:
        print(f"1,216 reads of real kernfs attributes (/sys/class/net/*/statistics/*, repeated), CPU per round: "
              f"open/read/close {kernfs[0] * 1000:.2f} ms, held + pread {kernfs[1] * 1000:.2f} ms "
              f"({kernfs[0] / kernfs[1]:.1f}x)")
    from healthagent.demo.node import build_demo_root

    with tempfile.TemporaryDirectory(prefix="bench-node-exporter-") as tmp:
        demo = build_demo_root(Path(tmp) / "root")
        sysfs = demo.root / "sys"
        exporter = NodeExporter(sysfs, Path(tmp) / "ne-plain.log")
        _, body = fetch(exporter.port)
        exporter.close()
        success = Scrape(body.decode()).value("node_scrape_collector_success", collector="infiniband")
        print(f"\non the demo tree as written: node_scrape_collector_success{{collector=\"infiniband\"}} = {success}, "
              f"node_infiniband_* series: {sum(exported(body, 'node_infiniband_').values())}")

        add_ib_core_files(demo.root)
        exporter = NodeExporter(sysfs, Path(tmp) / "ne.log")
        agent = AgentProcess(dict(host_root=demo.root, kube="dry-run", node_name="demo-p5-node", no_nvml=True,
                                  listen="127.0.0.1:0",
                                  state_file=Path(tmp) / "state.json", expected_efa_devices=32),
                             Path(tmp) / "agent.log",
                             env={"HEALTHAGENT_EFA_INTERVAL_SECONDS": str(EFA_INTERVAL_SECONDS)})
        try:
            agent.wait_metric(lambda s: s.value("healthagent_efa_devices") == 32, what="the agent's first cycle")
            _, ne_body = fetch(exporter.port)
            families = exported(ne_body, "node_infiniband_")
            print("with board_id, fw_ver, ports/1/rate and an empty ports/1/counters/ added, node_exporter exports:")
            print(table(["family", "series"], sorted(families.items())))

            fetch(agent.port)
            fetch(exporter.port)  # both warm
            # Rounds alternate: one without a scrape (the agent's background: its 1 s EFA collection,
            # classification, state file) and one with; the difference is the scrape. Alternating
            # keeps a slow drift of the background (histories filling up) out of the figure.
            quiet = with_scrape = ne_cpu = 0.0
            ne_wire = ag_wire = ne_raw = ag_raw = 0
            for step in range(args.scrapes):
                traffic(demo, 2 * step)
                before = agent.cpu_seconds()
                time.sleep(GAP_SECONDS)
                quiet += agent.cpu_seconds() - before
                traffic(demo, 2 * step + 1)
                before, ne_before = agent.cpu_seconds(), proc_cpu_seconds(exporter.proc.pid)
                time.sleep(GAP_SECONDS)  # a new EFA collection with moved counters before the scrape
                wire, raw = fetch(exporter.port)
                ne_wire, ne_raw = ne_wire + len(wire), ne_raw + len(raw)
                wire, raw = fetch(agent.port)
                ag_wire, ag_raw = ag_wire + len(wire), ag_raw + len(raw)
                with_scrape += agent.cpu_seconds() - before
                ne_cpu += proc_cpu_seconds(exporter.proc.pid) - ne_before
            background_rate = quiet / (args.scrapes * GAP_SECONDS)
            ne_cpu /= args.scrapes
            ag_cpu = (with_scrape - quiet) / args.scrapes
            ag_scrape = agent.scrape()
            ag_efa = sum(1 for s in ag_scrape.samples if s.name.startswith("healthagent_efa_"))
            collect_sum = ag_scrape.value("healthagent_collect_duration_seconds_sum", source="efa")
            collect_count = ag_scrape.value("healthagent_collect_duration_seconds_count", source="efa")
            n = args.scrapes
            print(f"\n{n} scrapes each, alternating, each after new counters, Accept as Prometheus sends, gzip; "
                  f"CPU from /proc (agent background {background_rate * 100:.2f}% of a core, from the rounds "
                  "without a scrape, subtracted)")
            print(table(["per scrape", "node_exporter", "healthagent", "healthagent / node_exporter"], [
                ["CPU", f"{ne_cpu * 1000:.2f} ms", f"{ag_cpu * 1000:.2f} ms", f"{ag_cpu / ne_cpu:.1f}x"],
                ["bytes on the wire (gzip)", f"{ne_wire // n:,}", f"{ag_wire // n:,}", f"{ag_wire / ne_wire:.1f}x"],
                ["bytes uncompressed", f"{ne_raw // n:,}", f"{ag_raw // n:,}", f"{ag_raw / ne_raw:.1f}x"],
                ["EFA series", sum(families.values()), ag_efa, f"{ag_efa / max(1, sum(families.values())):.1f}x"],
                ["EFA error counters exported", 0, sum(1 for s in ag_scrape.samples if s.name.startswith(
                    "healthagent_efa_") and ("err" in s.name or "drops" in s.name or "timeout" in s.name
                                             or "unresponsive" in s.name or "impaired" in s.name)), ""],
            ]))
            print(f"the agent's own sysfs read (not per scrape: every 10 s by default, every 1 s here): "
                  f"{collect_sum / collect_count * 1000:.1f} ms wall per EFA collection (mean of {collect_count:.0f})")

            # Per counter, each reading sysfs once per scrape (see the module docstring).
            cycle_cpu = quiet / (n * GAP_SECONDS / EFA_INTERVAL_SECONDS)
            ne_files = files_opened_per_scrape(exporter, sysfs)
            ag_files = efa_files_per_collection(sysfs)
            ne_series = sum(families.values())
            ag_read = ag_cpu + cycle_cpu
            print(f"\nper counter, each reading sysfs once per scrape (agent: a scrape {ag_cpu * 1000:.2f} ms + one "
                  f"collection cycle {cycle_cpu * 1000:.2f} ms of CPU)")
            print(table(["", "node_exporter", "healthagent", "healthagent / node_exporter"], [
                ["CPU per scrape, sysfs read included", f"{ne_cpu * 1000:.2f} ms", f"{ag_read * 1000:.2f} ms",
                 f"{ag_read / ne_cpu:.1f}x"],
                ["sysfs files read", ne_files if ne_files is not None else "? (no strace)", ag_files, ""],
                ["CPU per file read", f"{ne_cpu / ne_files * 1e6:.1f} us" if ne_files else "?",
                 f"{ag_read / ag_files * 1e6:.1f} us" if ag_files else "?",
                 f"{(ag_read / ag_files) / (ne_cpu / ne_files):.2f}x" if ne_files and ag_files else ""],
                ["EFA series exported", ne_series, ag_efa, ""],
                ["CPU per EFA series", f"{ne_cpu / ne_series * 1e6:.1f} us", f"{ag_read / ag_efa * 1e6:.1f} us",
                 f"{(ag_read / ag_efa) / (ne_cpu / ne_series):.2f}x"],
            ]))
            print(f"at the defaults (a collection every 10 s, a scrape every 15 s) the agent spends "
                  f"{(ag_cpu + 1.5 * cycle_cpu) * 1000:.2f} ms of CPU per scrape: "
                  f"{(ag_cpu + 1.5 * cycle_cpu) / ne_cpu:.1f}x node_exporter's")
        finally:
            agent.close()
            exporter.close()


if __name__ == "__main__":
    main()
