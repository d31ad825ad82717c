"""Every error but a clean ENOENT leaves an EFA device unobserved, never missing.

Real files under a tmp host root, broken the ways a hand-edited or hostile tree can be: a looping
class link, a ``device`` link into a loop, a file the agent may not read (mode 000), a directory
where a file belongs, a file where a directory belongs. Each device was first read healthy, so the
real classifier knows it: had the break made it *missing*, EFA_DEVICE_MISSING (reboot_node) would
follow; it must instead be named unobserved, with its errno, and lead to no node action.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from healthagent.config import load_settings
from healthagent.demo.node import write_efa_devices
from healthagent.model import Action, Collection
from healthagent.sources.efa import EfaSource
from healthagent.wiring import build_classifier

NOW = 1_700_000_000.0
PCI_IDS = ["0000:4f:00.0", "0000:50:00.0", "0000:51:00.0"]
VICTIM = "rdmap80s0"


def device_dir(root: Path, name: str = VICTIM) -> Path:
    return (root / "sys" / "class" / "infiniband" / name).resolve()


def loop(a: Path, b: Path) -> None:
    """Two links that name each other: following either is ELOOP."""
    os.symlink(a.name, b)
    os.symlink(b.name, a)


def looping_class_link(root: Path) -> None:
    virtual = root / "sys" / "devices" / "virtual"
    virtual.mkdir(parents=True, exist_ok=True)
    loop(virtual / "loop-a", virtual / "loop-b")
    link = root / "sys" / "class" / "infiniband" / VICTIM
    link.unlink()
    link.symlink_to("../../devices/virtual/loop-a")


def device_link_into_a_loop(root: Path) -> None:
    directory = device_dir(root)
    loop(directory / "loop-a", directory / "loop-b")
    (directory / "device").unlink()
    (directory / "device").symlink_to("loop-a")


def vendor_mode_000(root: Path) -> None:
    os.chmod(device_dir(root) / "device" / "vendor", 0)


def directory_for_the_vendor_file(root: Path) -> None:
    vendor = device_dir(root) / "device" / "vendor"
    vendor.unlink()
    vendor.mkdir()


def file_for_the_ports_directory(root: Path) -> None:
    ports = device_dir(root) / "ports"
    shutil.rmtree(ports)
    ports.write_text("not a directory\n")


def file_in_the_class_links_path(root: Path) -> None:
    """A file where a directory on the class link's way belongs (its ``infiniband`` parent)."""
    parent = device_dir(root).parent
    shutil.rmtree(parent)
    parent.write_text("not a directory\n")


def every_port_counter_a_directory(root: Path) -> None:
    counters = device_dir(root) / "ports" / "1" / "hw_counters"
    for entry in list(counters.iterdir()):
        if entry.name != "lifespan":
            entry.unlink()
            entry.mkdir()


# how -> (the break, the errno it shows, whether only a restarted agent reads the broken file: the
# PCI vendor is read once per registered device and kept while its identity stays the same).
BREAKS = {
    "looping class link": (looping_class_link, "ELOOP", False),
    "device link into a loop": (device_link_into_a_loop, "ELOOP", False),
    "vendor file mode 000": (vendor_mode_000, "EACCES", True),
    "directory for the vendor file": (directory_for_the_vendor_file, "EISDIR", True),
    "file for the ports directory": (file_for_the_ports_directory, "ENOTDIR", False),
    "file in the class link's path": (file_in_the_class_links_path, "ENOTDIR", False),
    "every port counter a directory": (every_port_counter_a_directory, "EISDIR", False),
}


def observe(judge, result, now: float):
    return judge.observe(Collection(timestamp=now, efa=result.efa, health=(result.health,),
                                    expected_efa_devices=len(PCI_IDS))).verdict


@pytest.mark.parametrize("how", list(BREAKS))
def test_a_device_that_cannot_be_seen_is_unobserved_never_missing(tmp_path, how):
    breaks, errno_name, restart = BREAKS[how]
    if errno_name == "EACCES" and os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file; the directory-for-a-file case covers another errno")
    write_efa_devices(tmp_path, PCI_IDS)
    source = EfaSource(str(tmp_path))
    judge = build_classifier(load_settings(env={}, flags={}))
    first = source.collect(NOW)
    assert observe(judge, first, NOW).action is Action.NONE and len(first.efa) == 3  # all three known
    breaks(tmp_path)
    if restart:
        source = EfaSource(str(tmp_path))  # the classifier still knows the three devices
    for step in range(1, 5):  # the inventory condition raises after a few bad readings: take several
        result = source.collect(NOW + 10 * step)
        verdict = observe(judge, result, NOW + 10 * step)
    assert result.health.up is False and result.health.unobserved == (VICTIM,)
    assert errno_name in result.health.detail and "unobserved (not missing)" in result.health.detail
    assert result.health.errors.get("unreadable", 0) >= 1
    assert sorted({s.device for s in result.efa}) == ["rdmap79s0", "rdmap81s0"]  # the others still read
    assert verdict.findings == () and verdict.action is Action.NONE
    assert "efa" in verdict.unobserved


def test_the_error_is_logged_with_its_errno(tmp_path, caplog):
    write_efa_devices(tmp_path, PCI_IDS)
    looping_class_link(tmp_path)
    with caplog.at_level("WARNING"):
        EfaSource(str(tmp_path)).collect(NOW)
    assert any(f"device={VICTIM}" in r.getMessage() and "ELOOP" in r.getMessage() for r in caplog.records)


def test_a_clean_enoent_is_still_missing(tmp_path):
    """The class entry and its PCI function gone (a hot unplug): the device is gone, not unobserved."""
    write_efa_devices(tmp_path, PCI_IDS)
    source = EfaSource(str(tmp_path))
    judge = build_classifier(load_settings(env={}, flags={}))
    observe(judge, source.collect(NOW), NOW)
    shutil.rmtree(device_dir(tmp_path).parent.parent)
    (tmp_path / "sys" / "class" / "infiniband" / VICTIM).unlink()
    for step in range(1, 5):
        result = source.collect(NOW + 10 * step)
        verdict = observe(judge, result, NOW + 10 * step)
    assert result.health.up is True and result.health.unobserved == ()
    [finding] = verdict.findings
    assert finding.code == "EFA_DEVICE_MISSING" and VICTIM in finding.evidence


def test_a_looping_link_that_is_repaired_is_read_again(tmp_path):
    write_efa_devices(tmp_path, PCI_IDS)
    link = tmp_path / "sys" / "class" / "infiniband" / VICTIM
    target = os.readlink(link)
    source = EfaSource(str(tmp_path))
    source.collect(NOW)
    looping_class_link(tmp_path)
    assert source.collect(NOW + 10).health.unobserved == (VICTIM,)
    link.unlink()
    link.symlink_to(target)
    again = source.collect(NOW + 20)
    assert again.health.up is True and len(again.efa) == 3
