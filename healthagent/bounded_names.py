"""The one bound on names that come from untrusted text or sysfs, before they become a series or a
finding.

Why one place: a label value or a finding's subject taken from a kernel-log line (a ConnectX PCI
id, the PCI id of an XID that matches no GPU, an NVSwitch's PCI id) or from a sysfs directory name
(an RDMA device and port) is chosen by whatever wrote that text. Without a bound, 6,000 distinct PCI
ids are 6,000 series, 6,000 findings, a state file past its cap and the memory to hold them all.
Every place that turns such a name into a series or a finding asks a ``NameBound`` for it:

- per source, the first ``limit`` distinct names are kept as they are (first come: the names a
  real node has are seen first and stay stable), far above any real node's count;
- every later name is folded into ``OVERFLOW`` ("~other": no PCI id, device or port is spelt so),
  one series and one finding for all of them; the finding keeps the most severe action of what it
  folded (``Action.most_severe``), so a fault behind a folded name is still acted on;
- each bound counts its folds (``folded``); the classifier adds its bounds' counts up for the
  snapshot, exported as ``healthagent_names_folded_total{source}``.

The kept names are bounded (``limit``), the overflow is one name, and the fold count is one integer
per bound: memory does not grow with the input.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

OVERFLOW = "~other"

# Names kept per source. A real node has at most a few dozen of each (8 GPUs, 4-12 NVSwitches,
# up to 18 ConnectX functions, more with SR-IOV virtual functions): these are far above that.
MLX5_ADAPTERS = 256
XID_UNMATCHED_PCI = 64
SXID_SWITCHES = 64
RDMA_PORTS = 256
# XID and SXid numbers the catalog does not know and the operator did not map: each is "monitor"
# (an SXid: its text's severity), so folding them changes no action.
UNMAPPED_NUMBERS = 64
# What a folded number becomes where a number is needed (an event's ``xid``); exported as OVERFLOW.
FOLDED_NUMBER = -1

T = TypeVar("T")


class NameBound:
    """The first ``limit`` distinct names of one source, kept; every other name is ``OVERFLOW``."""

    def __init__(self, source: str, limit: int) -> None:
        self.source = source
        self.limit = max(1, int(limit))
        self._kept: set[str] = set()
        self.folded = 0  # names folded into OVERFLOW by this bound

    def admit(self, name: str) -> str:
        """``name`` when it is kept (or there is room to keep it), else ``OVERFLOW`` (counted).
        "" (no name) is never a name to bound: it stays "" and costs nothing."""
        if not name or name in self._kept:
            return name
        if len(self._kept) < self.limit:
            self._kept.add(name)
            return name
        self.folded += 1
        return OVERFLOW

    def learn(self, names: Iterable[str]) -> None:
        """Keep these names first (a restart's saved subjects), as far as there is room."""
        for name in names:
            if name and name != OVERFLOW and len(self._kept) < self.limit:
                self._kept.add(name)

    def forget(self) -> None:
        """Start again (an operator's clear: the node's names are whatever comes next)."""
        self._kept.clear()


def keep_first(names: Iterable[T], limit: int) -> tuple[list[T], list[T]]:
    """The first ``limit`` of ``names`` and the rest: the bound where a pure function renders
    names in a stable order (a snapshot's sysfs ports), with no memory between calls."""
    kept: list[T] = []
    rest: list[T] = []
    for name in names:
        (kept if len(kept) < limit else rest).append(name)
    return kept, rest
