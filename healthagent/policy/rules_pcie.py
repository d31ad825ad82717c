"""PCIe AER rules: the Advanced Error Reporting statistics of the GPUs' and RDMA adapters' PCI
functions (``sources/pcie_aer.py``), as growth of cumulative counters (``counters.py``).

Why these actions (PCIe Base Specification's severities, Linux ``Documentation/PCI/pcieaer-howto``):

- **fatal** uncorrectable (``PCIE_AER_FATAL``, ``reboot_node``): the link itself is unreliable; the
  kernel's AER recovery resets it, and whatever the device was doing is lost. On a GPU this is
  the fault behind XID 79 (fallen off the bus), which the XID catalog maps to ``reboot_node``
  (NVIDIA: RESTART_BM): NVIDIA's driver does not bring a GPU back from a link reset, only a reboot
  does. An RDMA adapter's driver may recover its function, but the job's queue pairs on it are
  gone and the link partner has seen a fatal error, so the node is drained and rebooted the
  same way; a repeat after the reboot is hardware (the runbook says replace);
- **non-fatal** uncorrectable (``PCIE_AER_NONFATAL``, ``monitor``): one transaction was lost
  (a completion timeout, a poisoned TLP, an unsupported request) while the link stays up. Many
  platforms log unsupported requests while probing devices, so taking a node out for one would
  be a false action; the finding shows it and the runbook says when to drain;
- **correctable** (``PCIE_AER_CORRECTABLE``, ``monitor``): corrected by the link layer (replays,
  bad TLPs/DLLPs, receiver errors). Only a sustained rate matters (the row's ``sustain``): over
  ``pcie_aer_correctable_per_minute`` (DCGM's PCIe replay limit, 8 a minute: replays are counted
  here as ``Timeout``/``Rollover``) at every reading for five minutes, a marginal riser or slot.

Only growth counts. A count already there when the agent first reads a function is the baseline:
nothing says when those errors happened or whether they were dealt with, and a node action on
them would be a guess. A smaller count is a new baseline (a re-enumerated function, a reboot),
never a fault, and a severity whose file is absent or unreadable is not judged at all.
"""

from __future__ import annotations

from typing import Any, Iterator

from healthagent.model import Collection, GpuSample, PcieAerSample
from healthagent.policy.book import EVENT, Signal, Where
from healthagent.policy.counters import RatePart, SeriesTrack, rates_over
from healthagent.policy.findings import FINDINGS, duration_words, gpu_words, steps_for
from healthagent.policy.settings import Policy

FATAL, NONFATAL, CORRECTABLE = "PCIE_AER_FATAL", "PCIE_AER_NONFATAL", "PCIE_AER_CORRECTABLE"
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = (FATAL, NONFATAL, CORRECTABLE)
SERIES = ("fatal", "nonfatal", "correctable")
MAX_TRACKS = 256  # functions remembered; far above a real node, a bound for garbage state
MAX_NAMES_SHOWN = 4


class PcieTrack(SeriesTrack):
    """One function's counter histories and its last sample's time."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PcieTrack":
        return cls(**cls.base_fields(d, SERIES))


def function_words(sample: PcieAerSample, gpu: GpuSample | None) -> str:
    """``GPU 3 (0000:1a:00.0)``, or ``mlx5_0 (0000:4b:00.0)`` for an adapter."""
    if sample.role == "gpu":
        return gpu_words(gpu.index if gpu else None, sample.pci_bus_id)
    return f"{sample.device} ({sample.pci_bus_id})" if sample.device else sample.pci_bus_id


def _names(sample: PcieAerSample, severity: str) -> str:
    named = sorted(((n.split(":", 1)[1], v) for n, v in sample.errors.items() if n.startswith(severity + ":")),
                   key=lambda item: -item[1])[:MAX_NAMES_SHOWN]
    return f" (since enumeration: {', '.join(f'{n} {v}' for n, v in named)})" if named else ""


class PcieJudge:
    """The AER rules with their memory (per-function tracks). The classifier holds one."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.tracks: dict[str, PcieTrack] = {}

    def evaluate(self, collection: Collection, now: float) -> Iterator[Signal]:
        gpus = {g.pci_bus_id: g for g in collection.gpus if g.pci_bus_id}
        for sample in collection.aer:
            track = self._track(sample.pci_bus_id)
            t = track.new_sample(sample.timestamp, now)
            if t is None:
                continue
            gpu = gpus.get(sample.pci_bus_id) if sample.role == "gpu" else None
            yield from self._function(sample, gpu, track, t)

    def _track(self, key: str) -> PcieTrack:
        track = self.tracks.get(key)
        if track is None:
            if len(self.tracks) >= MAX_TRACKS:
                self.tracks.pop(next(iter(self.tracks)))
            track = self.tracks[key] = PcieTrack()
        return track

    def _function(self, sample: PcieAerSample, gpu: GpuSample | None, track: PcieTrack,
                  t: float) -> Iterator[Signal]:
        if sample.role == "gpu":
            where = Where(gpu.index if gpu else None, sample.pci_bus_id, gpu.uuid if gpu else "")
        else:
            where = Where(fabric_device=sample.device or sample.pci_bus_id)
        subject = function_words(sample, gpu)
        quiet = self.policy.counter_window_seconds
        for code, severity, value in ((FATAL, "fatal", sample.fatal), (NONFATAL, "nonfatal", sample.nonfatal)):
            if value is None:
                continue
            growth = track.counter(severity).add(t, value, self.policy.rate_window_seconds)
            if growth is None:
                continue
            if growth.increase > 0:
                evidence = (f"{severity} AER errors {growth.previous:.0f} -> {growth.current:.0f} in "
                            f"{duration_words(growth.seconds)}{_names(sample, severity)}")
                yield self._signal(code, where, subject, sample, evidence, quiet, int(growth.increase))
            elif self.policy.rules.counts(code):
                yield Signal(code=code, where=where, bad=False, kind=EVENT)
        if sample.correctable is not None:
            over = rates_over(track.counter, t, self.policy.rate_window_seconds, [
                RatePart("correctable", sample.correctable, self.policy.pcie_aer_correctable_per_minute,
                         "correctable AER errors")])
            if over:
                evidence = "; ".join(text for _, text in over) + _names(sample, "correctable")
                yield self._signal(CORRECTABLE, where, subject, sample, evidence, self.policy.counter_quiet_seconds,
                                   int(sum(n for n, _ in over)))
            elif self.policy.rules.counts(CORRECTABLE):
                yield Signal(code=CORRECTABLE, where=where, bad=False, kind=EVENT)

    @staticmethod
    def _signal(code: str, where: Where, subject: str, sample: PcieAerSample, evidence: str, quiet: float,
                count: int) -> Signal:
        info = FINDINGS[code]
        return Signal(code=code, where=where, bad=True, kind=EVENT, action=info.action,
                      summary=f"{subject}: {info.title}", evidence=evidence,
                      next_steps=steps_for(code, index=where.gpu_index, pci_bus_id=sample.pci_bus_id,
                                           device=subject),
                      quiet_seconds=quiet, count=max(1, count))

    def to_dict(self) -> dict[str, Any]:
        return {"tracks": {k: t.to_dict() for k, t in self.tracks.items()}}

    def load(self, d: Any, problems: list[str]) -> None:
        """What ``to_dict`` wrote; a bad function's history is dropped (and learned again)."""
        if not isinstance(d, dict):
            raise TypeError(f"{type(d).__name__} is not a mapping")
        for key, value in list((d.get("tracks") or {}).items())[:MAX_TRACKS]:
            try:
                self.tracks[str(key)] = PcieTrack.from_dict(value)
            except Exception as exc:  # this function's history starts clean
                problems.append(f"pcie track {str(key)[:40]}: {exc!r}"[:120])

