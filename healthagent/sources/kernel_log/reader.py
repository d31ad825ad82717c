"""The one interface every kernel-log input's reader has, as node-problem-detector's log watchers do.

Why: the source must not care whether records come from ``/dev/kmsg``, a followed file or the ring
through ``syslog(2)``. Each input differs in how it opens, resumes from a cursor and notices loss;
behind ``KernelLogReader`` they all hand the parser ``LogChunk``s and say where they stopped.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Callable, Protocol

from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.parser import LogChunk
from healthagent.sources.kernel_log.wake import DataWaiter

DEFAULT_KMSG = "/dev/kmsg"

# Every kernel-log module logs under the source's name, as one logger, so the lines an operator
# filters on (``healthagent.sources.kmsg ... source=kmsg event=open``) do not depend on the layout.
log = logging.getLogger("healthagent.sources.kmsg")

Sink = Callable[[LogChunk], None]
"""Where a reader hands its chunks, in log order, as it reads them (the source's parser)."""


class KernelLogReader(Protocol):
    """One open kernel-log input, reading on from where a cursor stopped.

    Opening is each reader's ``open`` class method: what it takes differs by input (a path, the
    ``syslog(2)`` call), but each one takes the saved ``KmsgCursor`` and whether it is this boot's,
    and resumes after the last record handed over. After that the source drives every reader alike.
    """

    description: str
    """The input in use, as the source's health detail names it (``/dev/kmsg (PATH)``, ...)."""
    keeps_earlier_boots: bool
    """True when the input may hold earlier boots' lines (a text file), so the parser marks
    events stamped before this boot ``previous_boot``; kernel inputs hold only this boot's."""

    def read(self, budget: int, now: float, sink: Sink) -> bool:
        """Hand ``sink`` up to ``budget`` new records; True when the budget ran out first (a
        backlog waits for the next call, nothing is dropped). Raises OSError when the input cannot
        be read; what was handed over before that is covered by ``cursor``."""
        ...

    def cursor(self, boot_id: str) -> KmsgCursor:
        """Where reading stopped: exactly after the last record handed to a sink."""
        ...

    def describe_failure(self, exc: OSError) -> str:
        """The health detail for ``exc`` raised by ``read`` (worded in ``wording``)."""
        ...

    def data_waiter(self) -> DataWaiter | None:
        """What wakes the loop when this input has new data (``wake``); None when nothing can say
        so, and the loop polls. Made before the first ``read``; the caller closes it."""
        ...

    def close(self) -> None:
        """Release the input; the reader is not used again."""
        ...


class InputError(OSError):
    """The input cannot be read; its ``strerror`` is the whole detail shown in the health."""


def is_char_device(path: str) -> bool:
    """Whether ``path`` is a character device (a real ``/dev/kmsg``) now; False when unreadable."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False
