"""The ``syslog(2)`` kernel-log reader's old import path (``docs/design.md`` names this file).

The code lives in ``healthagent.sources.kernel_log``: the system call in ``klogctl``, the telling of
new lines from old in ``ring``, following the ring in ``ring_reader``, decoding in ``formats``.
Each name is a re-export of one that was imported from here before; none is imported from here now.
"""

from __future__ import annotations

from healthagent.sources.kernel_log.formats import decode_text
from healthagent.sources.kernel_log.klogctl import (
    READ_BUFFER_FACTOR,
    SYSLOG_ACTION_READ_ALL,
    SYSLOG_ACTION_SIZE_BUFFER,
    KernelLog,
)
from healthagent.sources.kernel_log.ring import (
    TAIL_LINES,
    ResumeAfter,
    RingPosition,
    RingTracker,
    line_usec,
    rewind_lines,
)

__all__ = ["READ_BUFFER_FACTOR", "SYSLOG_ACTION_READ_ALL", "SYSLOG_ACTION_SIZE_BUFFER", "TAIL_LINES", "KernelLog",
           "ResumeAfter", "RingPosition", "RingTracker", "decode_text", "line_usec", "rewind_lines"]
