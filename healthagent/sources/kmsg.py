"""The kernel-log source's old import path; the code lives in ``healthagent.sources.kernel_log``.

Kept so that the modules that import these names from here keep working unchanged (agent.py and
cli.py, the demo and bench scripts, some tests). Each name is a re-export; point an importer at
the module named beside it, and this file can go once none is left.
"""

from __future__ import annotations

from healthagent.sources.kernel_log.cursor import KmsgCursor  # agent.py
from healthagent.sources.kernel_log.offline import iter_events  # cli.py, bench/, tests/
from healthagent.sources.kernel_log.source import KmsgSource  # agent.py, bench/, tests/demo

__all__ = ["KmsgCursor", "KmsgSource", "iter_events"]
