"""The effects worker (``healthagent/effects/worker.py``): newest verdict wins, wake-ups, retries,
survival of whatever the effects throw, and the SIGTERM contract (the write in flight finishes).

The effects here are ``Recorder``: real blocking code (an Event per call) that implements the
worker's ``Effects`` protocol and records what it was asked, so the test decides when a reconcile
"returns". The retry interval is long, so any reconcile seen sooner came from a wake-up, not a
timer; nothing asserts how long anything took.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from healthagent.effects.worker import EffectsWorker
from healthagent.model import KubeStatus, SourceHealth, Verdict
from tests.effects.helpers import HEALTHY, XID95, verdict
from tests.support.gated_source import LONG
from tests.support.wait import wait_for


@dataclass
class Outbox:
    dropped: int = 0


@dataclass
class Recorder:
    """An ``Effects`` whose reconcile blocks while ``gate`` is clear and can be told to raise."""

    mode: str = "dry-run"
    ledger: Outbox = field(default_factory=Outbox)
    errors: dict = field(default_factory=dict)
    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    seen: list = field(default_factory=list)
    health: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # "reconciled" / "closed", in order
    closed: bool = False
    raise_on_startup: bool = False
    raise_next: int = 0  # how many reconciles raise before the next one succeeds

    def __post_init__(self) -> None:
        self.gate.set()

    def startup(self, now: float, boot_id: str, wall: float | None = None) -> KubeStatus:
        if self.raise_on_startup:
            raise RuntimeError("startup broke")
        return KubeStatus(mode=self.mode, reachable=True)

    def reconcile(self, verdict: Verdict, now: float, boot_id: str,
                  health: tuple[SourceHealth, ...] = (), wall: float | None = None) -> KubeStatus:
        self.entered.set()
        if not self.gate.wait(LONG):
            raise AssertionError("the test never released the gate")
        self.seen.append(verdict)
        self.health.append(health)
        self.calls.append("reconciled")
        if self.raise_next:
            self.raise_next -= 1
            raise RuntimeError("reconcile broke")
        return KubeStatus(mode=self.mode, reachable=True, taint_effect="NoSchedule"
                          if verdict.action.needs_node_action else "")

    def close(self) -> None:
        self.calls.append("closed")
        self.closed = True


def started(effects: Recorder) -> EffectsWorker:
    worker = EffectsWorker(effects, "boot-1", clock=lambda: 1.0, retry_seconds=LONG)
    worker.start()
    return worker


def test_a_burst_of_verdicts_costs_one_reconcile_with_the_newest():
    effects = Recorder()
    worker = started(effects)
    xid = XID95.findings[0]
    try:
        worker.submit(HEALTHY)
        wait_for(lambda: worker.reconciles == 1, what="the first reconcile")
        effects.gate.clear()
        effects.entered.clear()
        worker.submit(verdict(replace(xid, count=1)))
        assert effects.entered.wait(LONG)  # a reconcile is in flight, blocked (a slow API)
        for count in range(2, 42):  # the burst lands meanwhile, each verdict new
            worker.submit(verdict(replace(xid, count=count)))
        newest = verdict(replace(xid, count=42))
        worker.submit(newest)
        effects.gate.set()
        wait_for(lambda: worker.reconciles == 3, what="the burst's one reconcile")
        assert effects.seen[-1] is newest and len(effects.seen) == 3
        assert worker.status.taint_effect == "NoSchedule"
    finally:
        worker.stop(LONG)


def test_the_same_verdict_again_wakes_nothing_but_wake_does():
    effects = Recorder()
    worker = started(effects)
    try:
        worker.submit(XID95, (SourceHealth(source="kmsg", up=True),))
        wait_for(lambda: worker.reconciles == 1, what="the first reconcile")
        worker.submit(XID95)  # same signature: no early reconcile (the retry interval is long)
        worker.wake()  # the node watch saw an operator's change: reconcile now
        wait_for(lambda: worker.reconciles == 2, what="the reconcile the wake-up asked for")
        assert effects.health[0] == (SourceHealth(source="kmsg", up=True),)
    finally:
        worker.stop(LONG)


def test_the_worker_survives_what_the_effects_throw_and_counts_it():
    effects = Recorder(raise_on_startup=True, raise_next=1)
    effects.ledger.dropped = 3
    effects.errors["rejected_403"] = 2
    worker = started(effects)
    try:
        worker.submit(HEALTHY)
        wait_for(lambda: worker.failures["reconcile_raised"] == 1, what="the raising reconcile")
        worker.submit(XID95)
        wait_for(lambda: worker.reconciles == 1, what="a reconcile after the failures")
        assert worker.errors() == {"rejected_403": 2, "events_dropped": 3, "startup_raised": 1,
                                   "reconcile_raised": 1}
    finally:
        worker.stop(LONG)


def test_stop_lets_the_write_in_flight_finish_then_closes_the_effects():
    effects = Recorder()
    worker = started(effects)
    effects.gate.clear()
    worker.submit(XID95)
    assert effects.entered.wait(LONG)
    stopper = threading.Thread(target=worker.stop, args=(LONG,))
    stopper.start()
    assert not effects.closed  # stop waits for the write in flight
    effects.gate.set()
    stopper.join(LONG)
    assert effects.calls[0] == "reconciled" and effects.calls[-1] == "closed"
    assert effects.seen[0] is XID95


def test_a_worker_never_started_stops_at_once_and_still_closes_the_effects():
    effects = Recorder()
    worker = EffectsWorker(effects, "boot-1", clock=lambda: 1.0, retry_seconds=LONG)
    assert worker.status == KubeStatus(mode="dry-run")
    worker.stop(LONG)
    assert effects.closed and effects.seen == []


def test_a_changed_status_wakes_the_loop_and_the_same_status_does_not():
    """The loop publishes the effects' status to /metrics when the worker says it changed, not
    on its next idle cycle: ``on_status`` rings once per change, never for the same status."""
    effects = Recorder()
    rang = []
    worker = EffectsWorker(effects, "boot-1", clock=lambda: 1.0, retry_seconds=LONG,
                           on_status=lambda: rang.append(worker.status))
    worker.start()
    try:
        wait_for(lambda: len(rang) == 1, what="the startup's status")  # the first status differs
        worker.submit(XID95)
        wait_for(lambda: worker.reconciles == 1, what="the tainting reconcile")
        wait_for(lambda: len(rang) == 2, what="the changed status to ring")
        assert rang[-1].taint_effect == "NoSchedule"
        worker.wake()  # the same verdict again: the same status, no ring
        wait_for(lambda: worker.reconciles == 2, what="the second reconcile")
        worker.submit(HEALTHY)
        wait_for(lambda: worker.reconciles == 3, what="the healing reconcile")
        wait_for(lambda: len(rang) == 3, what="the healed status to ring")
        assert [s.taint_effect for s in rang] == ["", "NoSchedule", ""]
    finally:
        worker.stop(LONG)
