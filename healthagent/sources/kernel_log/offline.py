"""The parser over finished kernel-log text: what ``healthagent classify`` reads.

Why apart from the source: saved text (dmesg, journalctl -k, syslog, /dev/kmsg records) has no
cursor, no reader and no health to report; it only needs the host's boot time for kernel stamps.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from healthagent.model import INIT_FAILED, XidEvent
from healthagent.common import ErrorTally
from healthagent.sources.kernel_log.boot import read_boot_time
from healthagent.sources.kernel_log.parser import SOURCE_NAME, XidLineParser


def iter_events(stream: Iterable[str], now: float, *, host_root: str = "/",
                tally: ErrorTally | None = None) -> Iterator[XidEvent]:
    """The XID events in kernel-log text (dmesg, journalctl -k, syslog, /dev/kmsg records).

    ``healthagent classify`` uses this. Reads ``stream`` line by line (any size). Kernel-relative
    stamps are converted with ``host_root``'s boot time, as on the node the text came from. A GPU
    that failed to initialise is no XID: ``check`` and the agent judge it, ``classify`` does not
    print it.
    """
    parser = XidLineParser(tally or ErrorTally(SOURCE_NAME), boot_time=read_boot_time(host_root, now),
                           now=now)
    yield from (event for event in parser.scan(stream) if event.kind != INIT_FAILED)
