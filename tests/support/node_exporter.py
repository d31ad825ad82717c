"""The real ``prometheus-node-exporter`` (Debian's package) with only its infiniband collector, on a
sysfs tree under a host root (``--path.sysfs``): what the agent's InfiniBand metrics are held to."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.observability import ServerProcess, free_port, wait_for

BINARY = "/usr/bin/prometheus-node-exporter"


def node_exporter_binary() -> str:
    """The binary, or skip the test naming the package."""
    found = shutil.which("prometheus-node-exporter") or (BINARY if Path(BINARY).exists() else None)
    if found is None:
        pytest.skip("prometheus-node-exporter not installed (Debian package prometheus-node-exporter)")
    return found


class InfinibandExporter:
    """node_exporter serving ``node_infiniband_*`` from ``sysfs``; ``stop`` ends it."""

    def __init__(self, sysfs: Path, log: Path, binary: str | None = None) -> None:
        self.port = free_port()
        self.server = ServerProcess([binary or node_exporter_binary(), f"--path.sysfs={sysfs}",
                                     "--collector.disable-defaults", "--collector.infiniband",
                                     f"--web.listen-address=127.0.0.1:{self.port}"], log)
        wait_for(self.text, timeout=30, what="node_exporter to answer")

    def text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def stop(self) -> None:
        self.server.stop()


def samples(text: str, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name without ``prefix``, sorted labels) -> value for every sample whose name starts with it."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix) and not sample.name.endswith("_created"):
                found[(sample.name[len(prefix):], tuple(sorted(sample.labels.items())))] = sample.value
    return found
