"""What the kernel can write in an RDMA device's sysfs files and a PCI function's AER statistics, and
nothing else, taken as a reading.

Every RDMA sysfs source (EFA, InfiniBand/RoCE) reads its values through these checks (by way of
``sysfs_reader``), so a value the kernel cannot produce is never evidence: the part it belongs to
is *unobserved* (a port state) or the value is absent and counted (a counter), never "down" and
never a jump in a counter.

The facts, from the kernel's ``drivers/infiniband/core/sysfs.c`` and ``include/rdma/ib_verbs.h``:

- ``state`` is ``"%d: %s"`` of ``enum ib_port_state`` (0 NOP, 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE,
  5 ACTIVE_DEFER), the words from ``state_show``'s own table;
- ``phys_state`` is ``"%u: %s"`` of ``phys_state_to_str`` (0 ``<unknown>``, 1 Sleep, 2 Polling,
  3 Disabled, 4 PortConfigurationTraining, 5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test; the IB
  PortPhysicalState values);
- ``counters/*`` (the PMA's PortCounters, ``PORT_PMA_ATTR``) are printed at their field's width:
  ``link_downed`` is 8 bits, so it can never read more than 255; the data and packet counters are
  64 bits where the extended counters are used (``PORT_PMA_ATTR_EXT``), 32 otherwise, so 64 is their
  bound; ``counters_ext/*`` (kernels before 4.5) and every ``hw_counters/*`` file are u64.

A number the kernel prints for a state but that is no member of its enum (``state_show`` prints
``UNKNOWN`` past the table) is refused as well: no driver reports one, and a state that is not
known cannot say whether a port is up.
"""

from __future__ import annotations

import re

# enum ib_port_state, with state_show's words.
PORT_STATES: dict[int, str] = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
# phys_state_to_str's table (IB PortPhysicalState).
PHYS_STATES: dict[int, str] = {0: "<unknown>", 1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining",
                               5: "LinkUp", 6: "LinkErrorRecovery", 7: "Phy Test"}

# counters/ file -> the width of its PortCounters field in bits (PORT_PMA_ATTR). A counter not named
# here (data and packet counters, counters_ext/, hw_counters/) is u64.
PMA_WIDTHS: dict[str, int] = {
    "symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16, "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8, "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16, "port_xmit_wait": 32,
}
U64 = 64  # a counter's width when ``PMA_WIDTHS`` does not name it: a value past it is garbage
NO_WIDTHS: dict[str, int] = {}  # every counter u64 (EFA hw_counters)

_STATE = re.compile(r"^\s*(\d{1,3})\s*:\s*(\S.*?)\s*$")
NO_PMA = b"N/A"  # "N/A (no PMA)": a port without a performance management agent has no counter


def parse_state(raw: bytes) -> tuple[int, str] | None:
    """``b"4: ACTIVE\\n"`` -> ``(4, "ACTIVE")``; None for anything else (the syntax only)."""
    match = _STATE.match(raw.decode("ascii", "replace"))
    return (int(match.group(1)), match.group(2)) if match else None


def kernel_state(raw: bytes, table: dict[int, str]) -> tuple[int, str] | None:
    """A state file's (number, words) when the kernel could have written it: a member of ``table``
    (``PORT_STATES``, ``PHYS_STATES``) with that member's words; None for anything else."""
    parsed = parse_state(raw)
    if parsed is None or table.get(parsed[0]) != parsed[1]:
        return None
    return parsed


def no_counter(raw: bytes) -> bool:
    """Text that says the port has no such counter (``N/A (no PMA)``): absent, not an error."""
    return raw.lstrip().startswith(NO_PMA)


# -- PCIe AER statistics (drivers/pci/pcie/aer.c, Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats)
#
# ``aer_dev_correctable``, ``aer_dev_nonfatal`` and ``aer_dev_fatal`` exist only on an AER-capable
# function (``aer_stats_attrs_are_visible``). Each is one ``"%s %llu\n"`` line per error the
# kernel names (``RxErr``, ``BadTLP`` ... for correctable; ``DLP``, ``CmpltTO``, ``MalfTLP`` ... for
# uncorrectable), a ``"<array>_bit[%d] %llu\n"`` line for a non-zero bit it has no name for, and
# last ``"TOTAL_%s %llu\n"`` with ERR_COR, ERR_NONFATAL or ERR_FATAL: the number of error messages
# of that severity the function reported since it was enumerated.
AER_FILES: dict[str, str] = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal",
                             "fatal": "aer_dev_fatal"}
AER_TOTALS: dict[str, str] = {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL",
                              "fatal": "TOTAL_ERR_FATAL"}
AER_BITS: dict[str, str] = {"correctable": "dev_cor_errs", "nonfatal": "dev_nonfatal_errs",
                            "fatal": "dev_fatal_errs"}
AER_MAX_LINES = 40  # 32 status bits and the total: a file this long is not the kernel's
# A count past 2**48 cannot be reached: the kernel handles AER messages one interrupt at a time,
# far below a million a second, and 2**48 at that rate takes nine years. A larger number (a
# u64 at its limit, a torn read) is garbage, and one read as growth would take a node out.
AER_MAX_COUNT = 2**48
_AER_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9_]{0,39}|dev_(?:cor|fatal|nonfatal)_errs_bit\[[0-9]{1,2}\]) "
                       r"([0-9]{1,20})$")


def parse_aer_stats(raw: bytes, severity: str) -> tuple[int, dict[str, int]] | None:
    """One ``aer_dev_*`` file: (its TOTAL, the non-zero counts by error name), or None when the text
    is not what the kernel writes for ``severity`` (a line of another shape, the TOTAL missing,
    another severity's TOTAL, a count past ``AER_MAX_COUNT``, a bit line of another array)."""
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        return None
    if not lines or len(lines) > AER_MAX_LINES:
        return None
    named: dict[str, int] = {}
    for line in lines[:-1]:
        match = _AER_LINE.match(line)
        if match is None or match.group(1).startswith("TOTAL_") or match.group(1) in named:
            return None
        name, value = match.group(1), int(match.group(2))
        if "[" in name and not name.startswith(AER_BITS[severity] + "_bit["):
            return None
        if value > AER_MAX_COUNT:
            return None
        named[name] = value
    last = _AER_LINE.match(lines[-1])
    if last is None or last.group(1) != AER_TOTALS[severity] or int(last.group(2)) > AER_MAX_COUNT:
        return None
    return int(last.group(2)), {name: value for name, value in named.items() if value}
