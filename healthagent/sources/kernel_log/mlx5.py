"""mlx5_core (ConnectX) kernel-log lines to adapter events; pure, no I/O.

Why here: the kernel log is where the mlx5 driver says what happened to an adapter (its firmware
stopped answering, it went fatal, a cable or module failed) before, or instead of, anything in
sysfs changing. The same readers, cursor, facility check and flood folding that serve XIDs serve
these lines; this module only says what one message means.

The wording is the driver's, matched by what it means rather than by one kernel's spelling: every
form the driver has printed since Linux 5.4 (``drivers/net/ethernet/mellanox/mlx5/core/health.c``,
``cmd.c``, ``events.c``, ``main.c``, ``diag/crdump.c``, checked up to 6.12), the vendor (MLNX_OFED)
trees' forms and lines from public logs; ``tests/fixtures/kmsg/mlx5-wordings.yaml`` holds one line
of each with its source. The driver prints ``mlx5_core <PCI id>: `` before every message
(``dev_err`` and friends), and its ``mlx5_core_err``/``_warn`` add ``<function>:<line>:(pid <n>): ``
(some kernels leave out the pid):

- ``poll_health``: ``device's health compromised - reached miss count`` (4.x: without the
  ``- reached miss count``); ``Fatal error %u detected`` (read without its number too: a line
  that says the adapter is fatal is not dropped for a missing sensor number);
  ``print_health_info``: ``Health issue observed, %s, severity(%d) %s:`` (before 6.0: ``synd
  0x%x: %s``) or ``PCI slot is unavailable`` (any words between ``PCI slot`` and ``is
  unavailable``);
- ``mlx5_fw_fatal_reporter_err_work``: ``Driver is in error state. Unloading``; ``health recovery
  failed``, ``health recovery flow aborted, PCI reads still not working`` (MLNX_OFED 4.x: ``health
  recovery flow aborted, NIC IFC still %d after %lums.``), ``health recovery succeeded``;
  ``crdump: failed to lock vsc gw err %d``;
- ``cmd.c``, a firmware command that got no answer: ``%s(0x%x) timeout. Will cause a leak of a
  command resource``, its asynchronous ``cmd[%d]: %s(0x%x) Async, timeout. Will cause a leak of a
  command resource`` (5.9 on; before: the synchronous sentence), and, after the EQ recovery's
  retry failed (5.9 on, 5.4.y), ``cmd[%d]: %s(0x%x) No done completion``; a command that never got
  a slot because every slot stayed busy: ``%s(0x%x) canceled on out of queue timeout.`` (5.7 on),
  ``%s(0x%x) timed out while waiting for a slot.`` and ``%s(0x%x) timeout while waiting for command
  semaphore.`` (6.10 on, 6.1.y and later stables); a command the EQ recovery found answered:
  ``cmd[%d]: %s(0x%x) recovered after timeout`` (``Async, recovered after timeout``);
- ``mlx5_pci_err_detected``: ``mlx5_pci_err_detected Device state = %d health sensors: %d
  pci_status: %d. Enter, pci channel state = %d`` (5.x: ``mlx5_pci_err_detected was called``);
- ``port_module``: ``Port module event[error]: module %u, %s, %s`` and ``Port module event:
  module %u, %s`` (older kernels spell ``Bus stuck(I2C or data shorted)`` and ``PCIe system power
  slot Exceeded``);
- ``temp_warn``: ``High temperature on sensors with bit set %llx %llx``; ``mlx5_pcie_event``:
  ``Detected insufficient power on the PCIe slot (%uW).``

The kernel has no "unsupported cable" sentence: a module the firmware will not run reports
``Unknown identifier``, ``Enforce part number list`` or ``Long Range for non MLNX cable``.

A line that carries one of these sentences but not the part it needs (a number cut off, a module
event without its status) raises ``Malformed``: the parser counts it (``parse``) and reports
nothing. Every other mlx5_core line (the hundreds the driver prints at boot) is no event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARK = "mlx5_core"

# "mlx5_core 0000:41:00.0: " or, for a netdev message, "mlx5_core 0000:41:00.0 ens1f0np0: ".
_DEVICE = re.compile(r"mlx5_core\s{1,4}(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}(?:\.[0-7])?)"
                     r"(?:\s{1,4}[\w.-]{1,32})?:\s{0,4}")
_FATAL = re.compile(r"Fatal error(?: (\d{1,9}))? detected")
_SLOT_UNAVAILABLE = re.compile(r"PCI slot\b[^\n]{0,60}?\bis unavailable")
_OLD_SYNDROME = re.compile(r"(?<![\w])synd 0x([0-9a-fA-F]{1,2}): ([^\n]{1,80})")
_SYNDROME = re.compile(r"Health issue observed, ([^,\n]{1,80}), severity\((\d{1,3})\)\s{0,4}([A-Za-z ]{0,20})")
_COMMAND = re.compile(r"(?:cmd\[-?\d{1,3}\]: )?([A-Z0-9_]{1,64})\((0x[0-9a-fA-F]{1,8})\)( Async,)? ")
# cmd.c's sentences for a command the firmware did not answer in time, by what each one means.
_NO_ANSWER = ("Will cause a leak of a command resource", "No done completion")
_NO_SLOT = ("canceled on out of queue timeout", "timed out while waiting for a slot",
            "timeout while waiting for command semaphore")
_PCI_ENTER = re.compile(r"pci channel state = (\d{1,3})")
_MODULE = re.compile(r"Port module event(\[error\])?: module (\d{1,3}), ([^,\n]{1,40})(?:, ([^\n]{1,160}))?")
_SENSORS = re.compile(r"bit set ([0-9a-fA-F]{1,16}) ([0-9a-fA-F]{1,16})")
_CRDUMP = re.compile(r"crdump: failed to lock vsc gw err (-?\d{1,6})")
_SLOT_POWER = re.compile(r"insufficient power on the PCIe slot \((\d{1,6})W\)")

# health.c's fatal sensors (check_fatal_sensors / mlx5_health_check_fatal_sensors), as numbered.
FATAL_SENSORS = {
    1: "PCI communication lost, reads return all ones",
    2: "PCI channel offline",
    3: "the NIC interface is disabled",
    4: "the NIC is in a software reset",
    5: "the firmware asks for a reset, its health syndrome set",
}
# include/linux/pci.h pci_channel_state_t.
PCI_CHANNEL_STATES = {1: ("pci_error_normal", "normal"), 2: ("pci_error_frozen", "frozen"),
                      3: ("pci_error_perm_failure", "permanent failure")}
MODULE_STATUSES = {"cable plugged": "module_plugged", "cable unplugged": "module_unplugged",
                   "cable disabled": "module_disabled"}
# events.c's mlx5_pme_error_to_string, by a phrase every kernel's spelling contains.
MODULE_ERRORS: tuple[tuple[str, str], ...] = (
    ("power budget", "module_power_budget_exceeded"),
    ("long range", "module_long_range_non_mlnx"),
    ("bus stuck", "module_bus_stuck"),
    ("no eeprom", "module_no_eeprom"),
    ("enforce part number", "module_enforce_part_number"),
    ("unknown identifier", "module_unknown_identifier"),
    ("high temperature", "module_high_temperature"),
    ("bad or shorted", "module_bad_cable"),
    ("pcie", "module_pcie_power_slot_exceeded"),
    ("unknown error", "module_unknown_error"),
)


class Malformed(ValueError):
    """A line with an mlx5 event's sentence but not the part the event needs."""


@dataclass(frozen=True)
class Mlx5Report:
    """What one mlx5_core message says: the catalog row, the adapter's PCI id as written ("" when
    the line does not name it) and what varies within the row."""

    event: str
    pci: str
    detail: str = ""


def read_report(message: str) -> Mlx5Report | None:
    """The event an mlx5_core message reports; None for the driver's other messages. Raises
    ``Malformed`` for a report that lost a part it needs."""
    device = _DEVICE.search(message)
    text = message[device.end():] if device is not None else message
    found = _event(text)
    if found is None:
        return None
    event, detail = found
    return Mlx5Report(event, device.group("pci") if device is not None else "", detail)


def _event(text: str) -> tuple[str, str] | None:
    """(event, detail) of the text after the device prefix, or None."""
    if "health compromised" in text:
        return "health_compromised", ""
    if "Fatal error" in text:
        fatal = _FATAL.search(text)
        if fatal is None:
            raise Malformed("'Fatal error' without 'detected'")
        if fatal.group(1) is None:
            return "fatal_error", "sensor not logged"
        sensor = int(fatal.group(1))
        return "fatal_error", f"sensor {sensor}: {FATAL_SENSORS.get(sensor, 'a sensor this agent does not know')}"
    if "Health issue observed" in text:
        syndrome = _SYNDROME.search(text)
        if syndrome is None:
            raise Malformed("'Health issue observed' without its syndrome and severity")
        level = syndrome.group(3).strip()
        return "health_syndrome", f"{syndrome.group(1).strip()}, severity {syndrome.group(2)}" + (
            f" {level}" if level else "")
    if "PCI slot" in text and _SLOT_UNAVAILABLE.search(text):
        return "pci_slot_unavailable", ""
    if "synd 0x" in text:
        syndrome = _OLD_SYNDROME.search(text)
        if syndrome is not None:
            return "health_syndrome", f"{syndrome.group(2).strip()}, syndrome 0x{syndrome.group(1)}"
    if "Driver is in error state" in text:
        return "driver_error_state", ""
    if "health recovery failed" in text or "health recovery flow aborted" in text:
        return "health_recovery_failed", ""
    if "health recovery succeeded" in text:
        return "health_recovery_succeeded", ""
    if "crdump: failed" in text:
        crdump = _CRDUMP.search(text)
        return "crdump_failed", f"err {crdump.group(1)}" if crdump else ""
    if "timeout" in text or "timed out" in text or "No done completion" in text:
        found = _command(text)
        if found is not None:
            return found
    if "pci_err_detected" in text:
        return _pci_error(text)
    if "Port module event" in text:
        return _module(text)
    if "High temperature on sensors" in text:
        sensors = _SENSORS.search(text)
        return "temp_warn", f"sensors {sensors.group(1)} {sensors.group(2)}" if sensors else ""
    if "insufficient power on the PCIe slot" in text:
        power = _SLOT_POWER.search(text)
        return "pcie_power_insufficient", f"{power.group(1)} W" if power else ""
    return None


def _command(text: str) -> tuple[str, str] | None:
    """A firmware command that timed out (``cmd_timeout``: no answer, or no free slot in the
    command queue, which only commands the firmware does not answer keep busy), or one the EQ
    recovery found answered after its timeout (``cmd_recovered``); the command as the detail."""
    if any(words in text for words in _NO_ANSWER):
        how = "no answer after the EQ recovery" if "No done completion" in text else ""
    elif any(words in text for words in _NO_SLOT):
        how = "no free command slot"
    elif "recovered after timeout" in text:
        return "cmd_recovered", _command_name(text)
    else:
        return None
    return "cmd_timeout", ", ".join(part for part in (_command_name(text), how) if part)


def _command_name(text: str) -> str:
    command = _COMMAND.search(text)
    if command is None:
        return ""
    return f"{command.group(1)}({command.group(2)})" + (" async" if command.group(3) else "")


def _pci_error(text: str) -> tuple[str, str] | None:
    """The AER callback's first line (its "Exit" line is the same error, not another)."""
    if "was called" in text:
        return "pci_error", "channel state not logged"
    if "Enter" not in text:
        return None
    state = _PCI_ENTER.search(text)
    if state is None:
        raise Malformed("pci_err_detected without its channel state")
    number = int(state.group(1))
    event, words = PCI_CHANNEL_STATES.get(number, ("pci_error", "unknown"))
    return event, f"channel state {number} ({words})"


def _module(text: str) -> tuple[str, str]:
    module = _MODULE.search(text)
    if module is None:
        raise Malformed("port module event without its module and status")
    where = f"module {int(module.group(2))}"
    status = module.group(3).strip().lower()
    if module.group(1) or status == "cable error":
        if not module.group(4):
            raise Malformed("port module error without its error type")
        error = module.group(4).strip().lower()
        event = next((name for phrase, name in MODULE_ERRORS if phrase in error), "module_unknown_error")
        return event, where
    if status in MODULE_STATUSES:
        return MODULE_STATUSES[status], where
    if status == "unknown status":
        return "module_unknown_status", where
    raise Malformed(f"port module event with an unreadable status {status[:40]!r}")
