"""Helpers for the effects tests: settings, findings, verdicts and NodeEffects built like the agent does."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.wait import wait_for  # noqa: F401  (re-exported for the effects tests)
from healthagent.config import Settings
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.model import Action, Finding, Verdict
from tests.support.kubefake import KubeFake

TAINT_KEY = "healthagent.io/unhealthy"
T0 = 1_700_000_000.0
XID95_LINE = "NVRM: Xid (PCI:0000:53:00): 95, pid=1234, name=python, Uncontained ECC error"


@dataclass
class Sleeps:
    """The injectable sleep: records the backoff delays instead of waiting."""

    delays: list = field(default_factory=list)

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class Wakes:
    """The ``on_change`` callback as the loop's effects worker has it: an Event it waits on, and a
    count of the wake-ups (called from the watch thread)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1
        self.event.set()

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait for a wake-up and consume it."""
        woke = self.event.wait(timeout)
        self.event.clear()
        return woke


def settings_for(tmp_path: Path, node: str, **overrides) -> Settings:
    values = dict(node_name=node, kube="in-cluster", state_file=str(tmp_path / "state" / "state.json"),
                  replace_noexecute_grace_seconds=120.0)
    values.update(overrides)
    return Settings(**values)


def start_effects(settings: Settings, fake: KubeFake | None, sleeps: Sleeps | None = None,
                  **kwargs) -> NodeEffects:
    """A NodeEffects over a freshly loaded state file, as the agent builds it after a restart.

    Without the watches unless ``watch=True``: these tests drive time through ``now`` and count
    every request, and the watches run in real time on their own threads - so they exercise the
    read-on-a-timer path the effects fall back to while a watch is down.
    tests/effects/test_kube_watch.py runs the node's watch, tests/effects/test_budget_watch.py the
    budget's."""
    store = StateStore(settings.state_file)
    store.load()
    kwargs.setdefault("request_timeout", (2.0, 5.0))
    kwargs.setdefault("watch", False)
    kwargs.setdefault("rng", random.Random(7))
    return NodeEffects(settings, fake.api_client() if fake is not None else None, store,
                       sleep=sleeps if sleeps is not None else Sleeps(), **kwargs)


def started(tmp_path: Path, fake: KubeFake, node: str = "gpu-node-0", **overrides) -> NodeEffects:
    """``start_effects`` for ``node`` after the agent's ``startup`` (at T0 - 1, boot-1)."""
    effects = start_effects(settings_for(tmp_path, node, **overrides), fake)
    effects.startup(T0 - 1, "boot-1")
    return effects


def finding(code: str = "GPU_XID", action: Action = Action.REPLACE_NODE, first_seen: float = T0,
            pci: str = "0000:53:00.0", efa: str = "", xids: tuple = (95,), finding_id: int = 1) -> Finding:
    return Finding(
        code=code, action=action,
        summary=f"{code} on {pci or efa}",
        evidence=XID95_LINE if xids else "counter rose",
        next_steps="drain and replace the node", pci_bus_id="" if efa else pci, fabric_device=efa,
        xids=xids, first_seen=first_seen, last_seen=first_seen, id=finding_id,
    )


def verdict(*findings: Finding, at: float = T0, unobserved: tuple = (), clear_token: str = "") -> Verdict:
    return Verdict.of(list(findings), at, unobserved=unobserved, clear_token=clear_token)


def cleared_by(token: str, *remaining: Finding) -> Verdict:
    """The verdict policy hands over once it accounted for the operator's clear ``token``: the
    findings the clear covered are closed, ``remaining`` (opened after it) stay."""
    return verdict(*remaining, clear_token=token)


HEALTHY = Verdict.of([], T0)
XID95 = verdict(finding())  # the product's promise: replace_node


def our_taints(node: dict) -> list[dict]:
    return [t for t in node.get("spec", {}).get("taints") or [] if t["key"] == TAINT_KEY]


def condition(node: dict, ctype: str) -> dict:
    return next(c for c in node["status"]["conditions"] if c["type"] == ctype)
