"""What every benchmark script prints and computes the same way: the machine, percentiles, a table.

Run the scripts from the repository root as modules (``.venv/bin/python -m bench.<name>``) so
they can import the test support code they share with the reliability suite (the fake API
server, the agent subprocess runner).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Iterable, Sequence


def machine() -> str:
    """One line naming the machine a figure was taken on (docs/benchmarks.md quotes it)."""
    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPUs ({model}), {ram_gib:.0f} GiB RAM, Python {platform.python_version()}, "
            f"Linux {platform.release()}, no GPU, {time.strftime('%Y-%m-%d')}")


def percentile(values: Sequence[float], share: float) -> float:
    """Nearest-rank percentile (``share`` in 0..1) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-share * len(ordered) // 1))))
    return ordered[rank - 1]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain aligned text table (what the scripts print)."""
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text_rows]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in text_rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


# The Accept header Prometheus 2.x sends on a scrape (scrape/scrape.go, acceptHeader): it selects
# OpenMetrics, whose encoder is slower than text 0.0.4, so render times are measured with it.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
