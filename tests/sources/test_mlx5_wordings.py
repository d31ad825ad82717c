"""Every wording of tests/fixtures/kmsg/mlx5-wordings.yaml, read by the real parser.

The fixture holds one line per wording the ConnectX driver has printed since Linux 5.4 (and the
vendor tree's) for a fatal adapter, a firmware command without an answer, a PCIe error and a
cable/module event, each with its source. The parser must read each as the event it means, with
its detail, whatever kernel printed it; the driver's other lines in the fixture are no event.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from healthagent.common import ErrorTally
from healthagent.policy.mlx5_catalog import event_ids
from healthagent.sources.kernel_log.mlx5 import Malformed, Mlx5Report, read_report
from healthagent.sources.kernel_log.offline import iter_adapter_events

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg" / "mlx5-wordings.yaml"
WORDINGS = yaml.safe_load(FIXTURE.read_text(encoding="utf-8"))
# The catalog's events that are not about a fatal adapter, a command, a PCIe error or a module
# (their wordings are in tests/sources/test_kernel_log_mlx5.py).
OTHER_EVENTS = {"crdump_failed", "temp_warn", "pcie_power_insufficient"}


def _pci(line: str) -> str:
    return line.split()[1].rstrip(":")


@pytest.mark.parametrize("entry", WORDINGS, ids=[w["line"].split(": ", 1)[1][:70] for w in WORDINGS])
def test_each_wording_is_read_as_what_it_means(entry):
    report = read_report(entry["line"])
    if entry["event"] is None:
        assert report is None
    else:
        assert report == Mlx5Report(entry["event"], _pci(entry["line"]), entry["detail"])


def test_every_wording_names_its_source():
    for entry in WORDINGS:
        assert set(entry) == {"line", "event", "detail", "source"}, entry
        assert len(entry["source"]) > 10, entry


def test_the_wordings_cover_every_fatal_command_pci_and_module_event_of_the_catalog():
    covered = {w["event"] for w in WORDINGS}
    module_rows = {e for e in event_ids() if e.startswith("module_")}
    # one line per module event is in test_kernel_log_mlx5.py; here the spellings that changed
    assert set(event_ids()) - OTHER_EVENTS - module_rows <= covered
    assert {"module_bus_stuck", "module_pcie_power_slot_exceeded"} <= covered


def test_both_command_timeout_paths_and_the_retry_are_one_event():
    """No answer (after the EQ recovery's retry or not) and no free slot are both cmd_timeout."""
    lines = [w for w in WORDINGS if w["event"] == "cmd_timeout"]
    assert any("No done completion" in w["line"] for w in lines)
    assert any("Will cause a leak" in w["line"] for w in lines)
    assert any("waiting for command semaphore" in w["line"] for w in lines)
    assert any("waiting for a slot" in w["line"] for w in lines)
    assert any("out of queue timeout" in w["line"] for w in lines)


@pytest.mark.parametrize("line, detail", [
    ("mlx5_core 0000:41:00.0: poll_health:785:(pid 0): Fatal error detected", "sensor not logged"),
    ("mlx5_core 0000:41:00.0: Fatal error 9 detected", "sensor 9: a sensor this agent does not know"),
])
def test_a_fatal_line_without_a_known_sensor_number_is_still_fatal(line, detail):
    assert read_report(line) == Mlx5Report("fatal_error", "0000:41:00.0", detail)


def test_a_fatal_line_cut_off_is_malformed_not_an_event():
    with pytest.raises(Malformed):
        read_report("mlx5_core 0000:41:00.0: poll_health:785:(pid 0): Fatal error 1")


@pytest.mark.parametrize("line", [
    "mlx5_core 0000:41:00.0: PCI slot 0000:41:00.0 is unavailable",
    "mlx5_core 0000:41:00.0: print_health_info:491:(pid 0): PCI slot is unavailable",
])
def test_the_slot_unavailable_line_is_read_with_words_in_between(line):
    assert read_report(line) == Mlx5Report("pci_slot_unavailable", "0000:41:00.0", "")


@pytest.mark.parametrize("line", [
    "mlx5_core 0000:0c:00.0: Port module event[error]: module 0, Cable error, No EEPROM/retry timeout",
    "mlx5_core 0000:41:00.0: print_health_info:394:(pid 0): ext_synd 0x8f3c",
    "mlx5_core 0000:41:00.0: mlx5_cmd_out_err:838:(pid 9): QUERY_VPORT_STATE(0x750) op_mod(0x0) failed, "
    "status bad parameter(0x3), syndrome (0x3a8c93), err(-22)",
])
def test_lines_with_the_timeout_or_syndrome_words_are_not_taken_for_those_events(line):
    report = read_report(line)
    assert report is None or report.event.startswith("module_")


def test_a_whole_adapter_failure_from_a_public_log_is_read_line_by_line():
    """The IBM log's sequence: the fatal line, the slot, then the command the firmware never
    answered: every line an event, in order, none malformed."""
    log = [f"[  649.{n:06d}] {w['line']}\n" for n, w in enumerate(WORDINGS) if w["source"].startswith("lore:68312f5c")]
    tally = ErrorTally("kmsg")
    events = [e.event for e in iter_adapter_events(log, 1000.0, tally=tally)]
    assert events == ["fatal_error", "pci_slot_unavailable", "cmd_timeout", "cmd_timeout"]
    assert not tally.snapshot()
