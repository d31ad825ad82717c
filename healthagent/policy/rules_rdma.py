"""InfiniBand and RoCE port rules: link state, rate, flaps, error rates and missing devices.

What an InfiniBand operator acts on, and why each default:
- **a port that was up and is not** (``RDMA_PORT_DOWN``, ``reboot_node``): the queue pairs on it
  go to error and NCCL aborts the job's collectives, so an elastic job must re-form without the
  node. "Was up" is remembered per port (saved with the classifier's state, so a restart or a
  reboot does not forget it); a port never seen up (the unused second port of a dual-port card,
  a cable never plugged) is not judged, unless the policy file's ``rdma_ports:`` says it must be
  up (and a port it names that is not there at all is down too). The rule waits 30 s (a link that
  recovers faster shows as a ``link_downed`` step) and 5 min after a boot (the subnet manager
  brings ports to ACTIVE);
- **a rate below the port's own** (``RDMA_PORT_DEGRADED``, ``monitor``): a 400 Gb/s port that
  trained at 200 runs, and drags every ring it is in to its speed. Expected is the highest rate
  the port ran at before, or that an up port of the same card model (``board_id``) and link layer
  on this node runs at now, or the rate ``rdma_ports:`` gives it, whichever is highest: a port
  that came up slow after a reboot is caught by its siblings, a node whose ports all did by the
  policy file;
- **flaps** (``RDMA_LINK_FLAPPING``, ``reboot_node``): each ``link_downed`` step is one
  occurrence for the code's rule (built in: 5 within a minute), so the count and the window are
  policy data (``findings:``);
- **error rates** (``monitor``): symbol errors, link recoveries and integrity errors, receive
  errors, transmit discards, each against a per-minute limit from infiniband-diags' default error
  thresholds;
- **congestion** (``port_xmit_wait``, CNPs, ECN marks, ``out_of_buffer``) is exported as metrics
  only: it is the fabric's and the job's business, not this node's health;
- a device seen earlier that is positively gone (``RDMA_DEVICE_MISSING``, ``reboot_node``).

A port the source could not read (named in ``SourceHealth.unobserved``) has no sample, so no
rule runs for it: it is never taken for down, and a finding open on it stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from healthagent.model import Collection, RdmaPort
from healthagent.policy.book import CONDITION, EVENT, Signal, Where
from healthagent.policy.counters import SeriesTrack, finite, rate_over
from healthagent.policy.findings import FINDINGS, clock, duration_words, steps_for
from healthagent.policy.inventory import missing, source_answered, unseen
from healthagent.policy.rdma_ports_file import PortExpectation
from healthagent.policy.settings import Policy

FLAPS = "link_downed"
# code, PortCounters summed, threshold name
RATE_RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("RDMA_SYMBOL_ERRORS", ("symbol_error",), "rdma_symbol_error_per_minute"),
    ("RDMA_LINK_ERRORS", ("link_error_recovery", "local_link_integrity_errors"), "rdma_link_error_per_minute"),
    ("RDMA_RCV_ERRORS", ("port_rcv_errors", "port_rcv_remote_physical_errors"), "rdma_rcv_errors_per_minute"),
    ("RDMA_XMIT_DISCARDS", ("port_xmit_discards",), "rdma_xmit_discards_per_minute"),
)
SERIES = (FLAPS,) + tuple(code for code, _, _ in RATE_RULES)
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = ("RDMA_PORT_DOWN", "RDMA_PORT_DEGRADED", "RDMA_LINK_FLAPPING", "RDMA_DEVICE_MISSING") + tuple(
    code for code, _, _ in RATE_RULES)
MAX_PORTS = 256  # ports remembered; far above a real node, a bound for garbage state
MAX_KNOWN = 256


@dataclass
class RdmaTrack(SeriesTrack):
    """One port's histories, when it was last seen up and the best rate it ran at."""

    last_up: float | None = None
    best_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "last_up": self.last_up, "best_rate": self.best_rate}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RdmaTrack":
        def number(key: str) -> float | None:
            value = d.get(key)
            if value is not None and not finite(value):
                raise TypeError(f"{key} {value!r} is not a number")
            return None if value is None else float(value)

        return cls(**cls.base_fields(d, SERIES), last_up=number("last_up"), best_rate=number("best_rate"))


def port_words(port: RdmaPort) -> str:
    """``mlx5_3/1 (ibp75s0, InfiniBand, 0000:4b:00.0)``."""
    parts = [p for p in (port.netdev, port.link_layer, port.pci_bus_id) if p]
    return f"{port.name} ({', '.join(parts)})" if parts else port.name


def _near(port: RdmaPort) -> str:
    return f"; GPUs behind its PCIe switch: {', '.join(port.gpus)}" if port.gpus else ""


def _signal(code: str, port: RdmaPort, evidence: str, kind: str = EVENT, **extra: Any) -> Signal:
    info = FINDINGS[code]
    return Signal(code=code, where=Where(fabric_device=port.name), bad=True, kind=kind, action=info.action,
                  summary=f"{port_words(port)}: {info.title}", evidence=evidence + _near(port),
                  next_steps=steps_for(code, device=port.name), **extra)


def _good(code: str, port: RdmaPort, kind: str) -> Signal:
    return Signal(code=code, where=Where(fabric_device=port.name), bad=False, kind=kind)


def peer_rates(ports: tuple[RdmaPort, ...]) -> dict[tuple[str, str], float]:
    """The highest rate an up port runs at now, by (card model, link layer)."""
    best: dict[tuple[str, str], float] = {}
    for port in ports:
        if port.up and port.rate_gbps is not None:
            key = (port.board_id, port.link_layer)
            best[key] = max(best.get(key, 0.0), port.rate_gbps)
    return best


class RdmaJudge:
    """The RDMA rules with their memory (per-port tracks, the devices seen). The classifier holds
    one; ``evaluate`` yields the signals of one observation."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.tracks: dict[str, RdmaTrack] = {}
        self.known: dict[str, str] = {}  # devices seen since the last clear
        self.inventory_time: float | None = None

    def evaluate(self, collection: Collection, now: float) -> Iterator[Signal]:
        peers = peer_rates(collection.rdma)
        for port in collection.rdma:
            track = self._track(port.name)
            t = track.new_sample(port.timestamp, now)
            if t is not None:
                yield from self._port(port, track, t, peers)
        yield from self._inventory(collection, now)

    def forget_devices(self) -> None:
        """An operator's clear: the devices are learned again from the next reading."""
        self.known.clear()

    def _track(self, key: str) -> RdmaTrack:
        track = self.tracks.get(key)
        if track is None:
            if len(self.tracks) >= MAX_PORTS:
                self.tracks.pop(next(iter(self.tracks)))
            track = self.tracks[key] = RdmaTrack()
        return track

    def _port(self, port: RdmaPort, track: RdmaTrack, t: float,
              peers: dict[tuple[str, str], float]) -> Iterator[Signal]:
        expected = self.policy.port_expectation(port.name, port.netdev)
        if port.up:
            yield _good("RDMA_PORT_DOWN", port, CONDITION)
            yield from self._rate(port, track, peers, expected)
            track.last_up = t
        elif track.last_up is not None or (expected is not None and expected.up):
            why = (f"it was up at {clock(track.last_up)} UTC" if track.last_up is not None
                   else f"never seen up; the policy file expects it up (rdma_ports: {expected.pattern})")
            yield _signal("RDMA_PORT_DOWN", port,
                          f"state {port.state_id}: {port.state}, phys_state {port.phys_state_id}: {port.phys_state}; "
                          f"{why}", CONDITION, signature=f"{port.state_id}/{port.phys_state_id}")
        yield from self._flaps(port, track, t)
        yield from self._rates(port, track, t)

    def _rate(self, port: RdmaPort, track: RdmaTrack, peers: dict[tuple[str, str], float],
              expectation: PortExpectation | None) -> Iterator[Signal]:
        rate = port.rate_gbps
        if rate is None:
            return
        own = track.best_rate or 0.0
        sibling = peers.get((port.board_id, port.link_layer), 0.0)
        policy = (expectation.rate_gbps if expectation is not None else None) or 0.0
        expected = max(own, sibling, policy)
        if rate < expected:
            why = ("it ran at" if own >= max(sibling, policy) else
                   "its sibling ports of the same card model run at" if sibling >= policy else
                   f"the policy file expects (rdma_ports: {expectation.pattern})")
            yield _signal("RDMA_PORT_DEGRADED", port, f"rate {port.rate_text or f'{rate:g} Gb/sec'}; {why} "
                          f"{expected:g} Gb/sec", CONDITION, signature=f"{rate:g}/{expected:g}")
        else:
            yield _good("RDMA_PORT_DEGRADED", port, CONDITION)
        track.best_rate = max(own, rate)

    def _flaps(self, port: RdmaPort, track: RdmaTrack, t: float) -> Iterator[Signal]:
        value = port.counters.get(FLAPS)
        if value is None:
            return
        window = self.policy.rule("RDMA_LINK_FLAPPING").window or self.policy.rate_window_seconds
        series = track.counter(FLAPS)
        growth = series.add(t, float(value), max(window, self.policy.rate_window_seconds))
        if growth is not None and growth.increase > 0:
            steps = int(growth.increase)
            within, covered = series.increase_over(t, window)
            yield _signal("RDMA_LINK_FLAPPING", port,
                          f"link_downed +{steps} now (+{int(within)} in {duration_words(covered)}, is {value})",
                          quiet_seconds=self.policy.counter_quiet_seconds, count=steps, occurrences=steps)
        elif growth is not None and self.policy.rules.counts("RDMA_LINK_FLAPPING"):
            yield _good("RDMA_LINK_FLAPPING", port, EVENT)

    def _rates(self, port: RdmaPort, track: RdmaTrack, t: float) -> Iterator[Signal]:
        window = self.policy.rate_window_seconds
        for code, names, threshold in RATE_RULES:
            basis = tuple(n for n in names if n in port.counters)
            if not basis:
                continue  # a driver without these PortCounters (no PMA): nothing to judge
            per_minute = self.policy.thresholds[threshold]
            total = float(sum(port.counters[n] for n in basis))
            over = rate_over(track.counter(code), t, total, window, per_minute, basis)
            if over is not None:
                increase, covered = over
                yield _signal(code, port, f"{'+'.join(names)} +{increase:.0f} in {duration_words(covered)} "
                              f"(limit {per_minute:g}/min)", quiet_seconds=self.policy.counter_quiet_seconds,
                              count=max(1, int(increase)))
            elif self.policy.rules.counts(code):
                yield _good(code, port, EVENT)

    def _inventory(self, collection: Collection, now: float) -> Iterator[Signal]:
        """RDMA_DEVICE_MISSING once per new reading, on nodes that have (or had) RDMA devices."""
        times = [p.timestamp for p in collection.rdma if finite(p.timestamp) and p.timestamp > 0]
        t = max(times) if times else now
        if t == self.inventory_time or not source_answered(collection, ("rdma",), bool(collection.rdma), listed=True):
            return
        self.inventory_time = t
        yield from self._absent(collection)
        present = {p.device: p.device for p in collection.rdma}
        if not present and not self.known:
            return
        blind = tuple(sorted({name.split("/")[0] for name in unseen(collection, ("rdma",))}))
        yield missing("RDMA_DEVICE_MISSING", "RDMA devices", present, len(present), self.known, None, blind)

    def _absent(self, collection: Collection) -> Iterator[Signal]:
        """RDMA_PORT_DOWN for each port ``rdma_ports:`` names as ``device/port`` (no wildcard,
        ``up: true``) that the source's listing does not hold. Called only when the source listed
        its devices; a port of a device it could not read is unobserved, not absent. (A network
        interface's name cannot be told absent: nothing lists the interfaces a node should have.)"""
        named = [e for e in self.policy.rdma_ports if e.up and e.names_one_port and "/" in e.pattern]
        if not named:
            return
        present = {p.name for p in collection.rdma}
        blind_devices = {name.split("/")[0] for name in unseen(collection, ("rdma",))}
        for expectation in named:
            name = expectation.pattern
            if name in present or name.split("/")[0] in blind_devices:
                continue  # judged by its own reading, or there perhaps but unreadable: unobserved
            info = FINDINGS["RDMA_PORT_DOWN"]
            yield Signal(code="RDMA_PORT_DOWN", where=Where(fabric_device=name), bad=True, kind=CONDITION,
                         action=info.action, summary=f"{name}: {info.title}",
                         evidence=f"no such port among the {len(collection.rdma)} InfiniBand/RoCE ports read; "
                                  f"the policy file expects it up (rdma_ports: {name})",
                         next_steps=steps_for("RDMA_PORT_DOWN", device=name), signature="absent")

    # -- state ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"tracks": {k: t.to_dict() for k, t in self.tracks.items()}, "known": dict(self.known),
                "inventory_time": self.inventory_time}

    def load(self, d: Any, problems: list[str]) -> None:
        """What ``to_dict`` wrote; a bad port's history is dropped (and learned again)."""
        if not isinstance(d, dict):
            raise TypeError(f"{type(d).__name__} is not a mapping")
        for key, value in list((d.get("tracks") or {}).items())[:MAX_PORTS]:
            try:
                self.tracks[str(key)] = RdmaTrack.from_dict(value)
            except Exception as exc:  # this port's history starts clean
                problems.append(f"rdma track {str(key)[:40]}: {exc!r}"[:120])
        self.known = {str(k): str(v) for k, v in list((d.get("known") or {}).items())[:MAX_KNOWN]}
        value = d.get("inventory_time")
        self.inventory_time = float(value) if finite(value) else None
