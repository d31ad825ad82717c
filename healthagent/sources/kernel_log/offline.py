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
    mlx5 adapter events are not XIDs and are left out (``iter_adapter_events`` reads them).

    ``healthagent classify`` uses this. Reads ``stream`` line by line (any size). Kernel-relative
    stamps are converted with ``host_root``'s boot time, as on the node the text came from. A GPU
    that failed to initialise is no XID: ``check`` and the agent judge it, ``classify`` does not
    print it.
    """
    parser = XidLineParser(tally or ErrorTally(SOURCE_NAME), boot_time=read_boot_time(host_root, now),
                           now=now)
    yield from (event for event in parser.scan(stream)
                if isinstance(event, XidEvent) and event.kind != INIT_FAILED)


def iter_adapter_events(stream: Iterable[str], now: float, *, host_root: str = "/",
                        tally: ErrorTally | None = None) -> Iterator[AdapterEvent]:
    """The mlx5 (ConnectX) adapter events in kernel-log text, read as ``iter_events`` reads XIDs."""
    parser = XidLineParser(tally or ErrorTally(SOURCE_NAME), boot_time=read_boot_time(host_root, now),
                           now=now)
    yield from (event for event in parser.scan(stream) if isinstance(event, AdapterEvent))
