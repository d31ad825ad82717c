"""The inventory a node must have, from its EC2 instance type, read without the network.

A node that boots with 7 of its 8 GPUs, or 31 of 32 EFA devices, looks healthy to every rule that
only compares a device with itself: nothing was ever there to go missing. Only an expectation
catches it. On EC2 Nitro instances the firmware names the instance type in the DMI product name
(``/sys/devices/virtual/dmi/id/product_name`` reads e.g. ``p5.48xlarge``), so the agent can know
the expectation at boot with no instance-metadata call and no configuration. The bundled table
``healthagent/policy/instance_types.csv`` maps instance types to GPUs and EFA devices, each row
with its source; a blank cell is "unknown".

The GPU count is hardware: a p5.48xlarge always has 8 GPUs, so it is applied by default. The EFA
count is only the most the instance type supports (one EFA per network card); how many interfaces
a node really has is chosen at launch (launch template, EKS node group, HyperPod), and a fleet
launched with fewer would see EFA_DEVICE_MISSING, a reboot_node finding, on every node. So the
table's EFA count is applied only when ``efa_expected_from_instance_type`` is on (for fleets that
attach every interface, as AWS's P5 guidance and HyperPod do); otherwise a vanished device is
still caught, and ``expected_efa_devices`` states the count. Explicit settings always win. An unknown or
unreadable instance type (Xen instances say ``HVM domU``, other clouds their own names) leaves the
expectation unknown (None), as without this module: what cannot be read never sets an expectation
a node could then fall short of. A file that is not there (ENOENT) is a host without DMI and says
nothing; any other error (EACCES, ELOOP, EISDIR, EIO) is logged with its errno, since it hides an
instance type that may well be there.
"""

from __future__ import annotations

import csv
import io
import logging
import re
from importlib import resources

from healthagent.sources.base import host_path
from healthagent.sources.sysfs_paths import errno_text

log = logging.getLogger(__name__)

PRODUCT_NAME = "/sys/devices/virtual/dmi/id/product_name"
TABLE = "instance_types.csv"
MAX_READ_BYTES = 256
_INSTANCE_TYPE = re.compile(r"[a-z][a-z0-9-]*\.[a-z0-9-]+")


def read_instance_type(host_root: str) -> str | None:
    """The EC2 instance type the host's firmware names, or None (not EC2 Nitro, or unreadable)."""
    path = host_path(host_root, PRODUCT_NAME)
    try:
        with open(path, "rb") as fh:
            text = fh.read(MAX_READ_BYTES).decode("ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("instance type unreadable path=%s error=%s: the expected inventory stays unknown "
                    "(unobserved, never a count to fall short of)", path, errno_text(exc))
        return None
    return text if _INSTANCE_TYPE.fullmatch(text) else None


def _count(cell: str) -> int | None:
    cell = cell.strip()
    return int(cell) if cell else None


def load_table() -> dict[str, tuple[int | None, int | None]]:
    """instance type -> (GPUs, EFA devices) from the bundled CSV; None where a count is unknown."""
    text = resources.files("healthagent.policy").joinpath(TABLE).read_text(encoding="utf-8")
    return {row["instance_type"].strip(): (_count(row["gpus"]), _count(row["efa_devices"]))
            for row in csv.DictReader(io.StringIO(text))}


def instance_inventory(host_root: str) -> tuple[str, int | None, int | None] | None:
    """(instance type, GPUs, EFA devices) for this host, or None when the type is unknown."""
    instance_type = read_instance_type(host_root)
    if instance_type is None:
        return None
    counts = load_table().get(instance_type)
    if counts is None:
        return None
    return (instance_type, *counts)


def resolve_expected(host_root: str, gpus: int | None, efa_devices: int | None,
                     efa_from_table: bool = False) -> tuple[int | None, int | None]:
    """The expected (GPUs, EFA devices): the configured values, each None filled in from the
    instance type when the table knows it (EFA only with ``efa_from_table``: see the module doc)."""
    if gpus is not None and (efa_devices is not None or not efa_from_table):
        return gpus, efa_devices
    known = instance_inventory(host_root)
    if known is None:
        return gpus, efa_devices
    instance_type, table_gpus, table_efa = known
    if not efa_from_table:
        table_efa = None
    resolved = (table_gpus if gpus is None else gpus, table_efa if efa_devices is None else efa_devices)
    log.debug("expected inventory instance_type=%s gpus=%s efa_devices=%s (configured gpus=%s efa=%s)",
              instance_type, resolved[0], resolved[1], gpus, efa_devices)
    return resolved
