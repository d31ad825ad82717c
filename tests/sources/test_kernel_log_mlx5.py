"""mlx5_core (ConnectX) lines of the kernel log, read by the real parser and the real source.

Every line below is the driver's wording as Linux 6.12 prints it (the 6.12.117 source:
``mlx5_core_err``/``_warn`` put ``<function>:<line>:(pid <n>): `` after ``mlx5_core <PCI id>: ``,
``mlx5_core_info`` does not), plus the older kernels' spellings the module documents. The table
covers every row of ``healthagent/policy/mlx5_events.csv``, and the test says so.
"""

from __future__ import annotations

import pytest

from healthagent.common import ErrorTally
from healthagent.model import AdapterEvent, XidEvent
from healthagent.policy.mlx5_catalog import event_ids
from healthagent.sources.kernel_log.offline import iter_adapter_events, iter_classifiable, iter_events
from healthagent.sources.kernel_log.parser import LogChunk, XidLineParser
from healthagent.sources.kernel_log.repeats import REPEATS_KEPT, RepeatFolder
from healthagent.sources.kernel_log.source import KmsgSource
from tests.support.kmsg_host import BOOT_A, BTIME, NOW, make_host, record, xid_text

DEV = "mlx5_core 0000:41:00.0: "
PCI_CX = "0000:0c:00.0"
CX = f"mlx5_core {PCI_CX}: "

# (message as the driver prints it, event, canonical PCI id, detail)
LINES = [
    (DEV + "poll_health:801:(pid 0): device's health compromised - reached miss count",
     "health_compromised", "0000:41:00.0", ""),
    ("mlx5_core 0000:41:00.0: device's health compromised", "health_compromised", "0000:41:00.0", ""),  # 4.x
    (DEV + "poll_health:785:(pid 0): Fatal error 1 detected", "fatal_error", "0000:41:00.0",
     "sensor 1: PCI communication lost, reads return all ones"),
    (DEV + "print_health_info:431:(pid 0): Health issue observed, firmware internal error, severity(3) ERROR:",
     "health_syndrome", "0000:41:00.0", "firmware internal error, severity 3 ERROR"),
    (DEV + "print_health_info:425:(pid 0): PCI slot is unavailable", "pci_slot_unavailable", "0000:41:00.0", ""),
    (DEV + "mlx5_fw_fatal_reporter_err_work:657:(pid 231): Driver is in error state. Unloading",
     "driver_error_state", "0000:41:00.0", ""),
    (DEV + "mlx5_health_try_recover:343:(pid 231): health recovery failed", "health_recovery_failed",
     "0000:41:00.0", ""),
    (DEV + "mlx5_health_try_recover:338:(pid 231): health recovery flow aborted, PCI reads still not working",
     "health_recovery_failed", "0000:41:00.0", ""),
    (DEV + "health recovery succeeded", "health_recovery_succeeded", "0000:41:00.0", ""),
    (DEV + "mlx5_crdump_collect:50:(pid 231): crdump: failed to lock vsc gw err -16", "crdump_failed",
     "0000:41:00.0", "err -16"),
    ("mlx5_core 0000:03:00.0: wait_func:1186:(pid 112): ENABLE_HCA(0x104) timeout. Will cause a leak of a "
     "command resource", "cmd_timeout", "0000:03:00.0", "ENABLE_HCA(0x104)"),
    ("mlx5_core 0000:03:00.0: mlx5_cmd_comp_handler:947:(pid 0): cmd[3]: QUERY_VPORT_STATE(0x750) Async, "
     "timeout. Will cause a leak of a command resource", "cmd_timeout", "0000:03:00.0",
     "QUERY_VPORT_STATE(0x750) async"),
    ("mlx5_core 0000:03:00.0: wait_func_handle_exec_timeout:1049:(pid 112): cmd[5]: QUERY_Q_COUNTER(0x773) "
     "recovered after timeout", "cmd_recovered", "0000:03:00.0", "QUERY_Q_COUNTER(0x773)"),
    ("mlx5_core 0000:0d:00.0: mlx5_pci_err_detected Device state = 1 health sensors: 0 pci_status: 1. Enter, "
     "pci channel state = 1", "pci_error_normal", "0000:0d:00.0", "channel state 1 (normal)"),
    ("mlx5_core 0000:0d:00.0: mlx5_pci_err_detected Device state = 1 health sensors: 2 pci_status: 1. Enter, "
     "pci channel state = 2", "pci_error_frozen", "0000:0d:00.0", "channel state 2 (frozen)"),
    ("mlx5_core 0000:0d:00.0: mlx5_pci_err_detected Device state = 2 health sensors: 1 pci_status: 1. Enter, "
     "pci channel state = 3", "pci_error_perm_failure", "0000:0d:00.0", "channel state 3 (permanent failure)"),
    ("mlx5_core 0000:0d:00.0: mlx5_pci_err_detected was called", "pci_error", "0000:0d:00.0",
     "channel state not logged"),  # 5.x
    *[(f"{CX}port_module:258:(pid 0): Port module event[error]: module {n}, Cable error, {error}", event, PCI_CX,
       f"module {n}") for n, error, event in (
        (0, "Power budget exceeded", "module_power_budget_exceeded"),
        (1, "Long Range for non MLNX cable", "module_long_range_non_mlnx"),
        (0, "Bus stuck (I2C or data shorted)", "module_bus_stuck"),
        (0, "No EEPROM/retry timeout", "module_no_eeprom"),
        (0, "Enforce part number list", "module_enforce_part_number"),
        (0, "Unknown identifier", "module_unknown_identifier"),
        (0, "High Temperature", "module_high_temperature"),
        (0, "Bad or shorted cable/module", "module_bad_cable"),
        (0, "One or more network ports have been powered down due to insufficient/unadvertised power on the "
            "PCIe slot", "module_pcie_power_slot_exceeded"),
        (0, "Unknown error", "module_unknown_error"))],
    # older kernels: mlx5_core_info (no function prefix), other spellings
    (f"{CX}Port module event[error]: module 0, Cable error, Bus stuck(I2C or data shorted)", "module_bus_stuck",
     PCI_CX, "module 0"),
    (f"{CX}Port module event[error]: module 0, Cable error, PCIe system power slot Exceeded",
     "module_pcie_power_slot_exceeded", PCI_CX, "module 0"),
    *[(f"{CX}Port module event: module 0, {status}", event, PCI_CX, "module 0") for status, event in (
        ("Cable disabled", "module_disabled"), ("Unknown status", "module_unknown_status"),
        ("Cable plugged", "module_plugged"), ("Cable unplugged", "module_unplugged"))],
    ("mlx5_core 0000:0c:00.0: temp_warn:176:(pid 0): High temperature on sensors with bit set 0 1", "temp_warn",
     "0000:0c:00.0", "sensors 0 1"),
    ("mlx5_core 0000:0c:00.0: mlx5_pcie_event:297:(pid 411): Detected insufficient power on the PCIe slot (27W).",
     "pcie_power_insufficient", "0000:0c:00.0", "27 W"),
]

# What every ConnectX prints at boot and during normal life: none is an event, none an error.
BENIGN = [
    "mlx5_core 0000:41:00.0: firmware version: 28.39.1002",
    "mlx5_core 0000:41:00.0: 252.048 Gb/s available PCIe bandwidth (16.0 GT/s PCIe x16 link)",
    "mlx5_core 0000:41:00.0: Rate limit: 127 rates are supported, range: 0Mbps to 195312Mbps",
    "mlx5_core 0000:41:00.0: E-Switch: Total vports 2, per vport: max uc(128) max mc(2048)",
    "mlx5_core 0000:41:00.0: mlx5_pcie_event:299:(pid 1): PCIe slot advertised sufficient power (75W).",
    "mlx5_core 0000:41:00.0: mlx5_pci_err_detected Device state = 2 pci_status: 0. Exit, result = 3, need reset",
    "mlx5_core 0000:41:00.0 ibp65s0: Link up",
    "mlx5_ib: mlx5_ib_probe: done",
]

# Lines that carry an event's sentence but lost the part it needs (cut off, damaged).
MALFORMED = [
    DEV + "poll_health:785:(pid 0): Fatal error",
    DEV + "poll_health:785:(pid 0): Fatal error x1 detected",
    DEV + "print_health_info:431:(pid 0): Health issue observed, firmw",
    "mlx5_core 0000:0d:00.0: mlx5_pci_err_detected Device state = 1 health sensors: 0 pci_status: 1. Enter, pci ch",
    "mlx5_core 0000:0c:00.0: port_module:258:(pid 0): Port module event[error]: module 0, Cable err",
    "mlx5_core 0000:0c:00.0: port_module:258:(pid 0): Port module event[error]: module",
    "mlx5_core 0000:0c:00.0: Port module event: module 0, Cable plu",
]


def parser(tally: ErrorTally, **kw) -> XidLineParser:
    return XidLineParser(tally, boot_time=BTIME, now=NOW, **kw)


def test_the_table_covers_every_catalog_row():
    assert {event for _, event, _, _ in LINES} == set(event_ids())


@pytest.mark.parametrize("message,event,pci,detail", LINES, ids=[f"{e}-{i}" for i, (_, e, _, _) in enumerate(LINES)])
@pytest.mark.parametrize("form", ["dmesg", "kmsg", "journal"])
def test_each_line_is_its_event_in_every_format(message, event, pci, detail, form):
    line = {"dmesg": f"[   17.982092] {message}",
            "kmsg": f"3,812,17982092,-;{message}",
            "journal": f"Nov 20 10:11:12 gpu-node-17 kernel: {message}"}[form]
    tally = ErrorTally("kmsg")
    [found] = list(parser(tally, boot_id=BOOT_A).scan([line]))
    assert isinstance(found, AdapterEvent)
    assert (found.event, found.pci_bus_id, found.detail) == (event, pci, detail)
    assert found.line == line and found.message == message and found.device == ""
    assert tally.snapshot() == {}
    if form == "kmsg":
        assert (found.seq, found.boot_id, found.timestamp) == (812, BOOT_A, BTIME + 17.982092)
    if form == "dmesg":
        assert found.timestamp == pytest.approx(BTIME + 17.982092)


def test_the_drivers_other_lines_are_nothing_and_cost_nothing():
    tally = ErrorTally("kmsg")
    assert list(parser(tally).scan([f"[ 5.000000] {text}" for text in BENIGN])) == []
    assert tally.snapshot() == {}


@pytest.mark.parametrize("message", MALFORMED)
def test_a_damaged_line_is_counted_and_reported_as_nothing(message):
    tally = ErrorTally("kmsg")
    assert list(parser(tally).scan([f"[ 5.000000] {message}"])) == []
    assert tally.snapshot() == {"parse": 1}


def test_every_cut_of_every_line_never_raises():
    """Each line cut at every length: an event, nothing, or one counted parse error; never a crash."""
    tally = ErrorTally("kmsg")
    reader = parser(tally)
    cuts = 0
    for message, *_ in LINES:
        line = f"[ 5.000000] {message}"
        for end in range(0, len(line) + 1, 3):
            found = reader.parse(line[:end])
            assert found is None or isinstance(found, AdapterEvent)
            cuts += 1
    assert sum(tally.snapshot().values()) < cuts


def test_a_line_without_the_adapters_address_is_kept_and_counted():
    tally = ErrorTally("kmsg")
    [found] = list(parser(tally).scan(["[ 5.000000] mlx5_core: poll_health: Fatal error 5 detected"]))
    assert (found.event, found.pci_bus_id) == ("fatal_error", "")
    assert tally.snapshot() == {"parse": 1}


@pytest.mark.parametrize("prefix", ["12,100,5000,-;", "<12>[ 5.000000] ", "user  :err   : [ 5.000000] "])
def test_a_record_user_space_wrote_is_no_adapter_event(prefix):
    tally = ErrorTally("kmsg")
    assert list(parser(tally).scan([prefix + DEV + "poll_health:785:(pid 0): Fatal error 5 detected"])) == []
    assert tally.snapshot() == {"not_kernel_facility": 1}


def test_user_space_naming_the_driver_is_not_counted_unless_it_quotes_an_event():
    tally = ErrorTally("kmsg")
    lines = ["14,7,5000,-;systemd-udevd[512]: mlx5_core 0000:41:00.0 ibp65s0: renamed from ib0",
             "12,8,5000,-;" + DEV + "health recovery succeeded"]
    assert list(parser(tally).scan(lines)) == []
    assert tally.snapshot() == {"not_kernel_facility": 1}


def test_a_flood_of_one_module_event_folds_into_a_few_events_with_its_count():
    message = ("mlx5_core 0000:0c:00.0: port_module:258:(pid 0): Port module event[error]: module 0, "
               "Cable error, High Temperature")
    flood = [record(seq, message, "SUBSYSTEM=pci", "DEVICE=+pci:0000:0c:00.0", priority=3).split("\n")[0]
             for seq in range(1, 5001)]
    other = record(6000, "mlx5_core 0000:0c:00.0: Port module event: module 1, Cable unplugged").rstrip("\n")
    tally = ErrorTally("kmsg")
    reader = parser(tally, boot_id=BOOT_A, repeats=RepeatFolder())
    events = list(reader.feed(LogChunk(flood + [other], whole_records=True))) + reader.take_repeats()
    hot = [e for e in events if e.event == "module_high_temperature"]
    assert len(hot) == REPEATS_KEPT + 1
    assert sum(e.repeats for e in hot) == 5000
    assert hot[-1].repeats == 5000 - REPEATS_KEPT and hot[-1].seq == 5000  # the last line stands for the rest
    assert [e.event for e in events if e.event != "module_high_temperature"] == ["module_unplugged"]
    assert tally.snapshot() == {}


def test_an_xid_and_an_adapter_event_in_one_read_keep_their_own_types(tmp_path):
    host = make_host(tmp_path / "host", kmsg_text=(
        record(1, xid_text(79), priority=4)
        + record(2, DEV + "poll_health:785:(pid 0): Fatal error 5 detected", "SUBSYSTEM=pci", priority=3)
        + record(3, "mlx5_core 0000:41:00.0: firmware version: 28.39.1002", priority=6)))
    result = KmsgSource(str(host)).collect(NOW)
    assert result.health.up and result.health.errors == {}
    assert [(e.xid, e.seq) for e in result.xids] == [(79, 1)]
    assert [(e.event, e.seq, e.boot_id) for e in result.adapter_events] == [("fatal_error", 2, BOOT_A)]


def test_lines_of_an_earlier_boot_in_a_file_are_history(tmp_path):
    host = make_host(tmp_path / "host", kmsg_text=None)
    log = tmp_path / "kern.log"
    log.write_text(f"2024-01-10T03:14:15.000000+00:00 node kernel: [ 7215.1] {DEV}poll_health:785:(pid 0): "
                   "Fatal error 5 detected\n"
                   f"[   20.000000] {DEV}poll_health:801:(pid 0): device's health compromised - reached miss count\n")
    result = KmsgSource(str(host), kernel_log=str(log)).collect(NOW)
    assert [(e.event, e.previous_boot) for e in result.adapter_events] == [
        ("fatal_error", True), ("health_compromised", False)]


def test_the_xid_reader_reads_xids_only_the_adapter_reader_the_rest_and_classifys_both_in_order():
    text = [f"[ 6.000000] {DEV}poll_health:785:(pid 0): Fatal error 5 detected", f"[ 7.000000] {xid_text(94)}"]
    assert [type(e) for e in iter_events(text, NOW, host_root="/nonexistent")] == [XidEvent]
    assert [e.event for e in iter_adapter_events(text, NOW, host_root="/nonexistent")] == ["fatal_error"]
    assert [type(e) for e in iter_classifiable(text, NOW, host_root="/nonexistent")] == [AdapterEvent, XidEvent]
