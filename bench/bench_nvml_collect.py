"""What one NVML collection costs the agent, on whatever NVML this host has.

    .venv/bin/python -m bench.bench_nvml_collect [--collections 200] [--stub]

Runs the agent's own reader (``NvmlSource``) as the loop does: one first collection (``nvmlInit``,
the GPU inventory, the XID event thread's start), then ``--collections`` back to back, and prints
the first's wall time, the median, p99 and slowest of the rest, the GPUs read and whether the event
thread built its event set. On a GPU node it measures the real driver; ``--stub`` runs the bundled
8 x H100 demo scenario through the stub library instead (what the other benchmarks use). Reads
only; changes nothing on the node.
"""

from __future__ import annotations

import argparse
import time

from bench.common import machine, median, percentile, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collections", type=int, default=200)
    parser.add_argument("--stub", action="store_true", help="the stub library with the demo scenario")
    args = parser.parse_args()
    if args.stub:
        from healthagent.demo import stub_nvml
        from healthagent.demo.stub_setup import use_stub_nvml

        use_stub_nvml(stub_nvml.DEMO_SCENARIO)
    from healthagent.sources.nvml import NvmlSource

    source = NvmlSource()
    started = time.perf_counter()
    first = source.collect(time.time())
    first_seconds = time.perf_counter() - started
    if not first.health.up:
        raise SystemExit(f"NVML is down: {first.health.detail}")
    times = []
    for _ in range(args.collections):
        started = time.perf_counter()
        source.collect(time.time())
        times.append(time.perf_counter() - started)
    thread = source.event_thread
    built = bool(thread and thread.alive and thread.wait_built(1, 10.0))
    names = sorted({gpu.name for gpu in first.gpus})
    source.close()
    print(machine().replace("no GPU", f"{len(first.gpus)} x {', '.join(names)}" + (" (stub)" if args.stub else "")))
    print(f"NVML: {first.health.detail}; XID event set built: {built}")
    print(table(["what", "wall"], [
        ["first collection (init, inventory, event thread)", f"{first_seconds * 1000:.1f} ms"],
        [f"collection, median of {len(times)}", f"{median(times) * 1000:.2f} ms"],
        ["collection, p99", f"{percentile(times, 0.99) * 1000:.2f} ms"],
        ["collection, slowest", f"{max(times) * 1000:.2f} ms"],
        ["per GPU, median", f"{median(times) * 1000 / max(1, len(first.gpus)):.2f} ms"],
    ]))


if __name__ == "__main__":
    main()
