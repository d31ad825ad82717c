"""Fuzz the EFA sysfs reader with random trees under a host root.

Each example writes a small ``sys/`` tree: devices that are real EFAs (the right PCI vendor and
device id, bound to ``efa``) with counter files holding random bytes, devices that are something
else (another vendor, another driver, unbound), dangling and looping links, links that try to
leave the host root, directories and FIFOs where files belong, a file where a directory belongs.
``EfaSource.collect`` must never raise, report exactly the EFA devices, exactly the counter files
that hold a u64 (the others counted as parse errors), and never read outside the root. A device
that cannot be seen (a looping link, a file in place of its ports directory, not one counter file
of a directory readable) is named unobserved, never left out as if it were gone.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthagent.demo.node import write_rdma_device
from healthagent.sources.efa import EfaSource
from healthagent.sources.sysfs_files import MAX_COUNTER_VALUE

pytestmark = pytest.mark.reliability

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

COUNTERS = ("tx_bytes", "rx_drops", "no_completion_cmds", "rdma_read_wr_err", "retrans_pkts")
counter_bytes = st.one_of(
    st.integers(0, MAX_COUNTER_VALUE).map(lambda v: f"{v}\n".encode()),
    st.sampled_from([b"", b"\n", b"-1\n", b"18446744073709551616\n", b"N/A (no PMA)\n", b"0x10\n", b"1e3\n",
                     b" 7 \n", b"\x00\x01", b"9" * 40 + b"\n"]),
    st.binary(max_size=20),
)
kind = st.sampled_from(["efa", "efa", "efa", "other-vendor", "other-driver", "unbound"])
oddity = st.sampled_from(["none", "none", "dir-for-file", "fifo-for-file", "dangling-class-link",
                          "looping-class-link", "looping-device-link", "file-for-ports", "escaping-device-link",
                          "no-ports", "bad-name"])
UNOBSERVED = "unobserved"  # what ``build`` answers for a device the reader must name unobserved
device = st.tuples(kind, st.dictionaries(st.sampled_from(COUNTERS), counter_bytes, min_size=1, max_size=5),
                   st.dictionaries(st.sampled_from(COUNTERS), counter_bytes, max_size=3), oddity)


def u64(raw: bytes) -> int | None:
    text = raw.strip()
    if not text.isdigit() or len(text) > 20:
        return None
    value = int(text)
    return value if value <= MAX_COUNTER_VALUE else None


def build(root: Path, n: int, spec) -> tuple[str, dict[str, int] | str | None]:
    """Write device ``n``; (its name, the counters an EFA reader must report, None: not reported,
    or ``UNOBSERVED``)."""
    what, port_counters, device_counters, odd = spec
    name = f"rdmap{n}s0"
    pci = f"0000:{0x10 + n:02x}:00.0"
    vendor = "0x15b3" if what == "other-vendor" else "0x1d0f"
    driver = "mlx5_core" if what == "other-driver" else "efa"
    device_dir = write_rdma_device(root, name, pci, vendor=vendor, driver=driver,
                                   device_counters=dict.fromkeys(device_counters, 0),
                                   port_counters=dict.fromkeys(port_counters, 0))
    for directory, counters in ((device_dir / "hw_counters", device_counters),
                                (device_dir / "ports" / "1" / "hw_counters", port_counters)):
        for counter, raw in counters.items():  # the driver's file, any bytes at all
            os.chmod(directory / counter, 0o644)
            (directory / counter).write_bytes(raw)
    if what == "unbound":
        os.unlink(device_dir.parent.parent / "driver")
    class_link = root / "sys" / "class" / "infiniband" / name
    # one value per name, the port's where it reads as a u64, else the device's (old drivers list
    # every counter in both directories; a garbage copy does not hide a good one)
    readable = {"device": {k: u64(v) for k, v in device_counters.items() if u64(v) is not None},
                "port": {k: u64(v) for k, v in port_counters.items() if u64(v) is not None}}
    if odd in ("dir-for-file", "fifo-for-file"):
        victim = device_dir / "ports" / "1" / "hw_counters" / next(iter(port_counters))
        os.unlink(victim)
        if odd == "dir-for-file":
            victim.mkdir()
            if len(port_counters) == 1 and what == "efa":
                return name, UNOBSERVED  # not one counter of the port's directory can be read (EISDIR)
        else:
            os.mkfifo(victim)
        readable["port"].pop(victim.name, None)
    elif odd == "dangling-class-link":
        class_link.unlink()
        class_link.symlink_to("../../devices/nowhere")
        return name, None
    elif odd == "looping-class-link":  # ELOOP: whether it is an EFA at all cannot be seen
        class_link.unlink()
        class_link.symlink_to(name)
        return name, UNOBSERVED
    elif odd == "looping-device-link":
        os.unlink(device_dir / "device")
        os.symlink("loop-a", device_dir / "loop-b")
        os.symlink("loop-b", device_dir / "loop-a")
        os.symlink("loop-a", device_dir / "device")
        return name, UNOBSERVED
    elif odd == "file-for-ports":  # ENOTDIR listing the ports
        import shutil

        shutil.rmtree(device_dir / "ports")
        (device_dir / "ports").write_text("not a directory\n")
        return name, UNOBSERVED if what == "efa" else None
    elif odd == "escaping-device-link":
        os.unlink(device_dir / "device")
        os.symlink("../../../../../../../../../../../../../../sys/bus/pci/devices/0000:00:00.0", device_dir / "device")
        return name, None
    elif odd == "no-ports":
        import shutil

        shutil.rmtree(device_dir / "ports")
        return name, None
    elif odd == "bad-name":
        (device_dir / "hw_counters" / "Not-A-Counter").write_text("5\n")
    if what != "efa":
        return name, None
    return name, {**readable["device"], **readable["port"]}


@FUZZ
@given(st.lists(device, min_size=1, max_size=5))
def test_random_sysfs_trees(devices):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        wanted = {}
        unobserved = []
        for n, spec in enumerate(devices):
            name, counters = build(root, n, spec)
            if counters == UNOBSERVED:
                unobserved.append(name)
            elif counters is not None:
                wanted[name] = counters
        source = EfaSource(str(root))
        result = source.collect(1_700_000_000.0)
        again = source.collect(1_700_000_010.0)  # a second read of the same tree says the same
    got = {s.device: dict(s.counters) for s in result.efa}
    assert got == wanted
    assert {s.device: dict(s.counters) for s in again.efa} == wanted
    for sample in result.efa:
        assert sample.port == 1 and sample.pci_bus_id
        assert all(isinstance(v, int) and 0 <= v <= MAX_COUNTER_VALUE for v in sample.counters.values())
    assert result.health.unobserved == again.health.unobserved == tuple(unobserved)
    assert result.health.up is not unobserved
    assert "exception" not in result.health.errors
