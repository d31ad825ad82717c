"""GPU rules beyond single XIDs: ECC, row remapping, retired pages, lost GPUs, NVLink,
PCIe replay and throttling. Each returns ``Signal``s for the book; none reads a clock.

Sources of the thresholds (all overridable in the policy file):
- retired pages: NVIDIA's RMA guidance as DCGM's health watch implements it: 60 retired pages in
  total, or more than 15 double-bit retirements that keep growing (more than one a week);
- row remapping: NVIDIA's A100/H100 memory-error manual: a pending remap needs a GPU reset, a
  remap failure means the GPU is out of spare rows (RMA);
- PCIe replays: DCGM's limit of 8 a minute; NVLink: DCGM flags any replay/recovery error and CRC
  errors past 100 a second;
- corrected ECC ("SBE storm"): a rate over a threshold that is also accelerating against the
  previous window, because storms of corrected errors precede uncorrectable ones;
- a GPU the driver could not initialise (``RmInitAdapter failed`` in the kernel log) is not
  usable: NVIDIA's tools list no such GPU (``nvidia-smi`` cannot open it) and the driver only
  retries when a process opens it again. So it is ``reboot_node`` unless a GPU source lists that
  GPU working now (a later attempt succeeded: ``monitor``, on record).

Each rule reports its raw signal at every reading, present or not; when the finding opens (at
once, after a count, sustained, after the boot's grace) is its code's rule in the table of
``debounce.py``, not a timer here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from healthagent.model import Action, Collection, GpuSample, XidEvent
from healthagent.policy.book import CONDITION, EVENT, Signal, Where
from healthagent.policy.counters import RatePart, SeriesTrack, finite, optional_float, rates_over
from healthagent.policy.findings import FINDINGS, clock, duration_words, gpu_words, steps_for
from healthagent.policy.inventory import GPU_SOURCES, source_answered
from healthagent.policy.settings import Policy

WEEK = 7 * 24 * 3600.0
THERMAL_REASONS = {"hwthermalslowdown"}
POWER_REASONS = {"hwpowerbrakeslowdown"}
SERIES = ("dbe", "sbe", "nvlink", "nvlink_crc", "pcie", "retired_dbe")
# The finding codes this module's rules produce (each has its row in findings.csv; a test checks both ways).
PRODUCES = ("GPU_LOST", "GPU_INIT_FAILED", "GPU_ECC_DBE", "GPU_SBE_STORM", "GPU_ROW_REMAP_FAILURE",
            "GPU_ROW_REMAP_PENDING", "GPU_RETIRED_PAGES", "GPU_RETIRED_PAGES_PENDING", "GPU_NVLINK_ERRORS",
            "GPU_PCIE_REPLAY", "GPU_THERMAL_THROTTLE", "GPU_POWER_THROTTLE")


def gpu_key(gpu: GpuSample) -> str:
    return gpu.pci_bus_id or (f"uuid:{gpu.uuid}" if gpu.uuid else f"index:{gpu.index}")


def _reason(name: str) -> str:
    return "".join(ch for ch in str(name).lower() if ch.isalnum())


@dataclass
class GpuTrack(SeriesTrack):
    """What the rules remember about one GPU between collections."""

    uuid: str = ""
    dbe_scope: str = ""
    # When the slowdown began, for the evidence's words ("active for 6 min"); how long it must
    # last before the finding opens is the code's rule (``debounce.py``: sustain).
    thermal_since: float | None = None
    power_since: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "uuid": self.uuid, "dbe_scope": self.dbe_scope,
                "thermal_since": self.thermal_since, "power_since": self.power_since}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GpuTrack":
        return cls(**cls.base_fields(d, SERIES), uuid=str(d.get("uuid", "")),
                   dbe_scope=str(d.get("dbe_scope", "")), thermal_since=optional_float(d.get("thermal_since")),
                   power_since=optional_float(d.get("power_since")))


class GpuRules:
    """Evaluates every GPU sample that is new since the last collection."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def evaluate(self, gpu: GpuSample, track: GpuTrack, now: float) -> Iterator[Signal]:
        t = track.new_sample(gpu.timestamp, now)
        if t is None:
            return
        where = Where(gpu.index, gpu.pci_bus_id, gpu.uuid)
        yield self._condition(gpu, where, "GPU_LOST", gpu.lost,
                              f"NVML reports {gpu_words(gpu.index, gpu.pci_bus_id)} as lost (GPU_IS_LOST)",
                              "lost")
        if gpu.lost:
            return  # its other numbers are whatever was known before; do not judge them
        for rule in (self._dbe, self._sbe_storm, self._remap, self._retired, self._nvlink, self._pcie,
                     self._throttle):
            yield from rule(gpu, track, where, t)

    def init_failures(self, events: "tuple[XidEvent, ...]", collection: Collection) -> Iterator[Signal]:
        """GPU_INIT_FAILED for each ``RmInitAdapter failed`` report, judged against the GPUs the GPU
        sources list now: one they list working initialised on a later attempt (``monitor``); one
        they do not list, or any GPU while no GPU source answered, is not usable (``reboot_node``):
        the kernel log saw it fail and nothing saw it recover. A report without an address is
        judged by the count: every expected GPU listed working is ``monitor``."""
        answered = source_answered(collection, GPU_SOURCES, bool(collection.gpus))
        working = [g for g in collection.gpus if not g.lost]
        names = "/".join(sorted({h.source for h in collection.health if h.source in GPU_SOURCES and h.up})) or "NVML"
        for event in events:
            gpu = next((g for g in working if event.pci_bus_id and g.pci_bus_id == event.pci_bus_id), None)
            expected = collection.expected_gpus
            if not answered:
                recovered, seen = False, "no GPU source answered, so nothing shows that a later attempt succeeded"
            elif event.pci_bus_id:
                recovered = gpu is not None
                seen = (f"{names} lists it now as GPU {gpu.index}, so a later attempt succeeded" if gpu else
                        f"{names} lists {len(working)} working GPUs, not this one"
                        + (f" (expected {expected})" if expected is not None else ""))
            else:
                recovered = expected is not None and len(working) >= expected
                seen = f"{names} lists {len(working)} working GPUs" + (
                    f" of {expected} expected" if expected is not None else " (how many to expect is unknown)")
            where = Where(gpu.index, gpu.pci_bus_id, gpu.uuid) if gpu else Where(pci_bus_id=event.pci_bus_id)
            info = FINDINGS["GPU_INIT_FAILED"]
            subject = gpu_words(where.gpu_index, where.pci_bus_id) if where.pci_bus_id else "a GPU the log did not name"
            yield Signal(code="GPU_INIT_FAILED", where=where, bad=True, kind=EVENT,
                         action=Action.MONITOR if recovered else Action.REBOOT_NODE,
                         summary=f"{subject}: {info.title}" + ("; it initialised on a later attempt" if recovered
                                                                else "; it is not usable"),
                         evidence=f"kernel log at {clock(event.timestamp)} UTC: {event.message.strip()[:200]}; {seen}",
                         next_steps=steps_for("GPU_INIT_FAILED", index=where.gpu_index, pci_bus_id=where.pci_bus_id),
                         quiet_seconds=self.policy.xid_window_seconds, count=max(1, event.repeats),
                         occurrences=max(1, event.repeats))

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _signal(gpu: GpuSample, where: Where, code: str, evidence: str, **kw: Any) -> Signal:
        info = FINDINGS[code]
        return Signal(code=code, where=where, action=info.action, evidence=evidence,
                      summary=f"{gpu_words(gpu.index, gpu.pci_bus_id)}: {info.title}",
                      next_steps=steps_for(code, index=gpu.index, pci_bus_id=gpu.pci_bus_id), **kw)

    def _condition(self, gpu: GpuSample, where: Where, code: str, bad: bool, evidence: str,
                   signature: str) -> Signal:
        return self._signal(gpu, where, code, evidence, bad=bad, kind=CONDITION, signature=signature)

    def _event(self, gpu: GpuSample, where: Where, code: str, evidence: str, quiet: float,
               count: int = 1) -> Signal:
        return self._signal(gpu, where, code, evidence, bad=True, kind=EVENT, quiet_seconds=quiet,
                            count=max(1, count))

    def _absent(self, where: Where, code: str) -> Iterator[Signal]:
        """A reading of an event rule without its signal (ends a run its rule counts), when the
        code's rule counts runs at all."""
        if self.policy.rules.counts(code):
            yield Signal(code=code, where=where, bad=False, kind=EVENT)

    # -- rules ------------------------------------------------------------------------------------

    def _dbe(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        """Uncorrectable ECC growth. Volatile counts (since the driver loaded or the last GPU reset)
        are preferred; a non-zero volatile count on first sight is reported too: the GPU has not
        been reset since those DBEs."""
        scope, value = ("volatile", gpu.ecc.volatile_uncorrected)
        if value is None:
            scope, value = ("aggregate", gpu.ecc.aggregate_uncorrected)
        if value is None:
            return
        if track.dbe_scope != scope:
            track.dbe_scope = scope
            track.series.pop("dbe", None)
        growth = track.counter("dbe").add(t, value, self.policy.rate_window_seconds)
        if growth is None:
            return
        quiet = self.policy.counter_window_seconds
        if growth.increase > 0:
            yield self._event(gpu, where, "GPU_ECC_DBE",
                              f"{scope} DBE {growth.previous:.0f} -> {growth.current:.0f} in "
                              f"{duration_words(growth.seconds)}", quiet, int(growth.increase))
        elif scope == "volatile" and growth.without_baseline > 0:
            yield self._event(gpu, where, "GPU_ECC_DBE",
                              f"volatile DBE count is {growth.current:.0f} (since the driver loaded or "
                              f"the GPU was last reset)", quiet, int(growth.current))
        else:
            yield from self._absent(where, "GPU_ECC_DBE")

    def _sbe_storm(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        value = gpu.ecc.volatile_corrected
        if value is None:
            value = gpu.ecc.aggregate_corrected
        if value is None:
            return
        window = self.policy.sbe_window_seconds
        series = track.counter("sbe")
        if series.add(t, value, 2 * window) is None:
            return
        recent, covered = series.increase_over(t, window)
        rate = recent * 60.0 / max(covered, 60.0)
        previous = series.increase_between(t - 2 * window, t - window) * 60.0 / window
        if rate >= self.policy.sbe_storm_per_minute and rate > previous * self.policy.sbe_acceleration_factor:
            yield self._event(gpu, where, "GPU_SBE_STORM",
                              f"corrected ECC +{recent:.0f} in {duration_words(covered)} "
                              f"({rate:.1f}/min; the window before: {previous:.1f}/min)",
                              self.policy.counter_quiet_seconds, int(recent))
        else:
            yield from self._absent(where, "GPU_SBE_STORM")

    def _remap(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        remap = gpu.remap
        rows = f"remapped rows: correctable {_n(remap.correctable)}, uncorrectable {_n(remap.uncorrectable)}"
        if remap.failure is not None:
            yield self._condition(gpu, where, "GPU_ROW_REMAP_FAILURE", bool(remap.failure),
                                  f"NVML row remapper: failure occurred; {rows}", "failure")
        if remap.pending is not None:
            yield self._condition(gpu, where, "GPU_ROW_REMAP_PENDING", bool(remap.pending),
                                  f"NVML row remapper: remap pending (applied at the next GPU reset); {rows}",
                                  f"pending/{_n(remap.uncorrectable)}/{_n(remap.correctable)}")

    def _retired(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        pages = gpu.retired_pages
        if pages.single_bit is not None or pages.double_bit is not None:
            sbe, dbe = pages.single_bit or 0, pages.double_bit or 0
            series = track.counter("retired_dbe")
            if not series.points or series.points[-1][1] != dbe:
                series.add(t, dbe, WEEK)  # change points only: a week of history stays small
            weekly = series.increase_between(t - WEEK, t)
            total_limit, dbe_limit = self.policy.retired_pages_limit, self.policy.retired_pages_dbe_limit
            bad = sbe + dbe >= total_limit or (dbe > dbe_limit and weekly > 1)
            yield self._condition(
                gpu, where, "GPU_RETIRED_PAGES", bad,
                f"retired pages: {sbe} single-bit + {dbe} double-bit = {sbe + dbe} (limit {total_limit:.0f}); "
                f"double-bit retirements in the last week: {weekly:.0f} (limit: more than 1 past "
                f"{dbe_limit:.0f})", f"{sbe}/{dbe}")
        if pages.pending is not None:
            yield self._condition(gpu, where, "GPU_RETIRED_PAGES_PENDING", bool(pages.pending),
                                  "NVML: pages are pending retirement (applied at the next driver load or "
                                  "GPU reset)", "pending")

    def _rate(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float, code: str,
              parts: list[RatePart]) -> Iterator[Signal]:
        """One finding per code when any of its counters grows faster than its limit per minute."""
        over = rates_over(track.counter, t, self.policy.rate_window_seconds, parts)
        if over:
            yield self._event(gpu, where, code, "; ".join(text for _, text in over),
                              self.policy.counter_quiet_seconds, int(sum(n for n, _ in over)))
        elif any(finite(part.value) for part in parts):
            yield from self._absent(where, code)

    def _nvlink(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        errors = {k: v for k, v in (gpu.nvlink_errors or {}).items() if finite(v)}
        if not errors:
            return
        replay_recovery = _sum(errors, ("replay", "recovery"))
        crc = _sum(errors, ("crc_flit", "crc_data"))
        yield from self._rate(gpu, track, where, t, "GPU_NVLINK_ERRORS", [
            RatePart("nvlink", replay_recovery, self.policy.nvlink_errors_per_minute,
                     "NVLink replay+recovery errors"),
            RatePart("nvlink_crc", crc, self.policy.nvlink_crc_errors_per_second * 60, "NVLink CRC errors"),
        ])

    def _pcie(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        yield from self._rate(gpu, track, where, t, "GPU_PCIE_REPLAY", [
            RatePart("pcie", gpu.pcie_replay, self.policy.pcie_replay_per_minute, "PCIe replays")])

    def _throttle(self, gpu: GpuSample, track: GpuTrack, where: Where, t: float) -> Iterator[Signal]:
        active = {_reason(r) for r in gpu.throttle_reasons or ()}
        for code, reasons, attr in (("GPU_THERMAL_THROTTLE", THERMAL_REASONS, "thermal_since"),
                                    ("GPU_POWER_THROTTLE", POWER_REASONS, "power_since")):
            if not active & reasons:
                setattr(track, attr, None)
                yield self._condition(gpu, where, code, False, "", "")
                continue
            since = getattr(track, attr)
            if since is None or since > t:
                setattr(track, attr, t)
                since = t
            names = "/".join(sorted(str(r) for r in gpu.throttle_reasons if _reason(r) in reasons))
            temp = f"; {gpu.temperature_c:.0f} C" if finite(gpu.temperature_c) else ""
            power = f"; {gpu.power_w:.0f} W" if finite(gpu.power_w) else ""
            yield self._condition(gpu, where, code, True,
                                  f"{names} active for {duration_words(t - since)}{temp}{power}", "active")


def _n(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _sum(values: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    present = [values[k] for k in keys if k in values]
    return float(sum(present)) if present else None
