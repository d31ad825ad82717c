"""Where ``healthagent demo --prepare DIR`` may write a demo host root, and what it does with a
folder that already holds something.

Two demo nodes written into one folder are one host with both fabrics (32 EFA devices and 10
InfiniBand/RoCE ports, "healthy"), which no real node is; and a folder the user keeps something
else in is not the demo's to fill or to empty. So a folder is written when it is new or empty; a
folder holding a demo node of the same fabric is written again from scratch (preparing twice
gives the same node); a demo node of the other fabric is replaced only with ``--replace``; and a
folder holding anything else is refused, ``--replace`` or not: ``--prepare`` never deletes what it
did not write. A marker file at the root says which fabric a prepared folder holds; nothing in
the agent reads it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, TypeVar

MARKER = ".healthagent-demo"  # at the root of a prepared folder: the fabric written there
Node = TypeVar("Node")


class PrepareRefused(Exception):
    """``--prepare`` cannot write there; ``str()`` is one line with the fix."""


def prepared_fabric(root: Path) -> str | None:
    """The fabric of the demo node ``--prepare`` wrote into ``root``, or None (not a demo folder)."""
    try:
        return (root / MARKER).read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def make_room(root: Path, fabric: str, replace: bool) -> None:
    """Make ``root`` ready for a demo node of ``fabric``, or raise ``PrepareRefused``."""
    where = str(root)
    if root.exists() and not root.is_dir():
        raise PrepareRefused(f"demo: --prepare {where}: is a file, not a folder; name a new or empty folder")
    try:
        entries = list(root.iterdir()) if root.exists() else []
    except OSError as exc:
        raise PrepareRefused(f"demo: --prepare {where}: cannot list it ({exc.strerror}); name a folder you "
                             "can write") from None
    if not entries:
        return
    written = prepared_fabric(root)
    if written is None:
        raise PrepareRefused(f"demo: --prepare {where}: the folder is not empty and holds no demo node; name "
                             "a new or empty folder (--prepare never deletes what it did not write)")
    if written != fabric and not replace:
        raise PrepareRefused(f"demo: --prepare {where}: it holds the {written} demo node, and --fabric {fabric} "
                             "would make one host of both; name another folder, or add --replace to write "
                             f"the {fabric} node in its place")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def prepare(root: Path, fabric: str, replace: bool, build: Callable[[Path], Node]) -> Node:
    """Write the demo node ``build`` writes into ``root`` under the rules above; one line
    (``PrepareRefused``) for anything that stops it, an unwritable place (``/proc``) included."""
    root = Path(os.path.abspath(root))
    try:
        make_room(root, fabric, replace)
        root.mkdir(parents=True, exist_ok=True)
        # First: a build cut short leaves a folder that the next --prepare knows to write again.
        (root / MARKER).write_text(fabric + "\n", encoding="ascii")
        node = build(root)
    except OSError as exc:
        raise PrepareRefused(f"demo: --prepare {root}: cannot write there ({exc.strerror or exc}); name a "
                             "folder you can write, e.g. /tmp/demo-node") from None
    return node
