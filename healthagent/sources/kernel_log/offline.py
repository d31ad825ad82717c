"""The parser over finished kernel-log text: what ``healthagent classify`` reads.

Why apart from the source: saved text (dmesg, journalctl -k, syslog, /dev/kmsg records) has no
cursor, no reader and no health to report; it only needs the host's boot time for kernel stamps.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from healthagent.model import INIT_FAILED, AdapterEvent, XidEvent
from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.boot import read_boot_time
from healthagent.sources.kernel_log.parser import SOURCE_NAME, XidLineParser


def iter_events(stream: Iterable[str], now: float, *, host_root: str = "/",
                tally: ErrorTally | None = None) -> Iterator[XidEvent]:
    """The XID events in kernel-log text (dmesg, journalctl -k, syslog, /dev/kmsg records); its
    mlx5 adapter events are not XIDs and are left out (``iter_adapter_events`` reads them,
    ``iter_classifiable`` both, for ``healthagent classify``).

    Reads ``stream`` line by line (any size). Kernel-relative stamps are converted with
    ``host_root``'s boot time, as on the node the text came from. A GPU that failed to initialise
    is no XID: ``check`` and the agent judge it, ``classify`` does not print it.
    """
    yield from (event for event in _scan(stream, now, host_root, tally)
                if isinstance(event, XidEvent) and event.kind != INIT_FAILED)


def iter_adapter_events(stream: Iterable[str], now: float, *, host_root: str = "/",
                        tally: ErrorTally | None = None) -> Iterator[AdapterEvent]:
    """The mlx5 (ConnectX) adapter events in kernel-log text, read as ``iter_events`` reads XIDs."""
    yield from (event for event in _scan(stream, now, host_root, tally) if isinstance(event, AdapterEvent))


def iter_classifiable(stream: Iterable[str], now: float, *, host_root: str = "/",
                      tally: ErrorTally | None = None) -> Iterator[XidEvent | AdapterEvent]:
    """The XIDs and the mlx5 adapter events of kernel-log text, in the text's order, from one pass:
    what ``healthagent classify`` prints (a failed GPU initialisation is left out, as
    ``iter_events`` leaves it out). One pass, because the input may be stdin."""
    yield from (event for event in _scan(stream, now, host_root, tally)
                if isinstance(event, AdapterEvent) or (isinstance(event, XidEvent) and event.kind != INIT_FAILED))


def _scan(stream: Iterable[str], now: float, host_root: str,
          tally: ErrorTally | None) -> Iterator[XidEvent | AdapterEvent]:
    """Every record the parser yields, its kernel stamps dated by ``host_root``'s boot time."""
    parser = XidLineParser(tally or ErrorTally(SOURCE_NAME), boot_time=read_boot_time(host_root, now),
                           now=now)
    return parser.scan(stream)
