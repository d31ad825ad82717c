"""The DRA calls with no cluster: a dry run that says each DeviceTaintRule write instead of making it.

Why: ``healthagent demo --dra`` shows the per-GPU quarantine on a machine without Kubernetes. It
stands where ``DraApi`` stands, so ``DraEffects`` decides exactly as against a cluster: the
ResourceSlices are the ones it is given (shaped as NVIDIA's DRA driver publishes them), the
cluster serves DeviceTaintRules, and each create, change or delete is logged ("dry-run: would
...") and kept, so the next pass reads back what it would have written. Nothing leaves the process.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from typing import Iterator

log = logging.getLogger(__name__)


class QuietStream:
    """A watch stream on which nothing happens until it is interrupted (the slices never change)."""

    def __init__(self) -> None:
        self._ended = threading.Event()

    def lines(self) -> Iterator[str]:
        self._ended.wait()
        return iter(())

    def interrupt(self) -> None:
        self._ended.set()

    def close(self) -> None:
        self._ended.set()


class DryRunDraApi:
    """``DraApi``'s calls against the given slices and an in-process set of rules."""

    def __init__(self, node_name: str, slices: list[dict]) -> None:
        self.node_name = node_name
        self._slices = copy.deepcopy(slices)
        self._lock = threading.Lock()
        self.written: dict[str, dict] = {}  # rule name -> body, as it would stand in the cluster
        self.events: list[dict] = []

    def serves_rules(self) -> bool:
        return True

    def slices(self) -> list:
        return copy.deepcopy(self._slices)

    def list_slices(self) -> tuple[list, str]:
        return self.slices(), "dry-run"

    def watch_slices(self, resource_version: str, timeout_seconds: int) -> QuietStream:
        return QuietStream()

    def rules(self) -> list:
        with self._lock:
            return copy.deepcopy(list(self.written.values()))

    def create(self, body: dict) -> None:
        log.info("dry-run: would create DeviceTaintRule %s", _words(body))
        with self._lock:
            self.written[body["metadata"]["name"]] = copy.deepcopy(body)

    def replace(self, name: str, body: dict) -> None:
        log.info("dry-run: would change DeviceTaintRule %s", _words(body))
        with self._lock:
            self.written[name] = copy.deepcopy(body)

    def delete(self, name: str) -> None:
        log.info("dry-run: would delete DeviceTaintRule %s", name)
        with self._lock:
            self.written.pop(name, None)

    def annotate_node(self, key: str, value: str | None) -> None:
        if value is None:
            log.info("dry-run: would remove annotation %s from node %s", key, self.node_name)
        else:
            log.info("dry-run: would set annotation %s=%s on node %s", key, value, self.node_name)

    def event(self, body: dict) -> None:
        log.info("dry-run: would create Event %s: %s", body.get("reason"), body.get("note"))
        with self._lock:
            self.events.append(copy.deepcopy(body))


def _words(body: dict) -> str:
    return f"{body['metadata']['name']} {json.dumps(body['spec'], sort_keys=True)}"
