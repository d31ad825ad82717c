"""A GPU node's InfiniBand/RoCE sysfs tree under a host root, laid out as the kernel lays it out.

The shape is a DGX H100-style node: eight single-port ConnectX-7 functions (``mlx5_0``..``mlx5_7``,
NDR InfiniBand, 400 Gb/s), each behind one PCIe switch with one H100; and a dual-port ConnectX-7
for storage in Ethernet mode (``mlx5_8``, ``mlx5_9``: RoCE, 200 Gb/s) under its own root port,
with no GPU beside it. File names, their places and the text in them follow real dumps: the
mlx5 port of prometheus/procfs' sysfs fixture (``counters/``, ``hw_counters/``, ``link_layer``,
``"4: ACTIVE"``, ``"25 Gb/sec (1X EDR)"``), the kernel's ``rate_show`` (``"400 Gb/sec (4X NDR)"``)
and ``Documentation/ABI/stable/sysfs-class-infiniband``; relative symlinks as sysfs has them
(``class/infiniband/mlx5_0 -> ../../devices/pci.../infiniband/mlx5_0``). ``mlx5_7`` also has the
``counters_ext/`` directory of kernels before 4.5 (64-bit data and packet counters), so both
places are exercised. Every PCI function carries healthy AER statistics (``write_aer_stats``, the
text of ``drivers/pci/pcie/aer.c``), which the p5 demo node's functions share.

``healthagent demo --fabric ib`` builds its node's ports with it, and the tests build theirs, so
one layout serves both: it lives in the package because the demo runs where ``tests/`` is not
installed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

IB_COUNTERS = (
    "VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
    "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets",
    "port_rcv_constraint_errors", "port_rcv_data", "port_rcv_errors", "port_rcv_packets",
    "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors", "port_xmit_constraint_errors",
    "port_xmit_data", "port_xmit_discards", "port_xmit_packets", "port_xmit_wait", "symbol_error",
    "unicast_rcv_packets", "unicast_xmit_packets",
)
LEGACY_COUNTERS = (
    "port_multicast_rcv_packets", "port_multicast_xmit_packets", "port_rcv_data_64", "port_rcv_packets_64",
    "port_unicast_rcv_packets", "port_unicast_xmit_packets", "port_xmit_data_64", "port_xmit_packets_64",
)
HW_COUNTERS_IB = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer", "out_of_sequence",
    "packet_seq_err", "req_cqe_error", "req_cqe_flush_error", "req_remote_access_errors",
    "req_remote_invalid_request", "req_rnr_retries_exceeded", "req_transport_retries_exceeded",
    "resp_cqe_error", "resp_cqe_flush_error", "resp_local_length_error", "resp_remote_access_errors",
    "rnr_nak_retry_err", "rx_atomic_requests", "rx_dct_connect", "rx_read_requests", "rx_write_requests",
)
HW_COUNTERS_ROCE = HW_COUNTERS_IB + (
    "np_cnp_sent", "np_ecn_marked_roce_packets", "roce_adp_retrans", "roce_adp_retrans_to",
    "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans", "rp_cnp_handled",
    "rp_cnp_ignored", "rx_icrc_encapsulated",
)
NDR = "400 Gb/sec (4X NDR)"
HDR = "200 Gb/sec (4X HDR)"
ACTIVE, LINK_UP = "4: ACTIVE", "5: LinkUp"
DOWN, DISABLED, POLLING = "1: DOWN", "3: Disabled", "2: Polling"


@dataclass(frozen=True)
class Port:
    device: str
    pci: str
    link_layer: str
    netdev: str
    gpu: str = ""  # the GPU behind the same switch ("" for the storage card)


@dataclass(frozen=True)
class RdmaTree:
    """The tree under ``root`` and the handles a fault is written through (the demo's, a test's)."""

    root: Path
    ports: tuple[Port, ...] = ()

    def port_dir(self, device: str, port: int = 1) -> Path:
        return (self.root / "sys/class/infiniband" / device).resolve() / "ports" / str(port)

    def write(self, device: str, relative: str, text: str, port: int = 1) -> None:
        path = self.port_dir(device, port) / relative
        tmp = path.with_name(path.name + ".new")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)  # a reader sees the old text or the new, never half

    def set_state(self, device: str, state: str, phys_state: str, port: int = 1) -> None:
        self.write(device, "state", state, port)
        self.write(device, "phys_state", phys_state, port)

    def set_rate(self, device: str, rate: str, port: int = 1) -> None:
        self.write(device, "rate", rate, port)

    def counter(self, device: str, name: str, port: int = 1) -> int:
        for directory in ("counters", "hw_counters", "counters_ext"):
            path = self.port_dir(device, port) / directory / name
            if path.exists():
                return int(path.read_text())
        raise KeyError(name)

    def bump(self, device: str, name: str, by: int, port: int = 1) -> int:
        for directory in ("counters", "hw_counters", "counters_ext"):
            if (self.port_dir(device, port) / directory / name).exists():
                value = self.counter(device, name, port) + by
                self.write(device, f"{directory}/{name}", str(value), port)
                return value
        raise KeyError(name)

    def remove_device(self, device: str) -> None:
        """The driver unregistered it: its class link and its directory are gone."""
        target = (self.root / "sys/class/infiniband" / device).resolve()
        (self.root / "sys/class/infiniband" / device).unlink()
        shutil.rmtree(target)


def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(os.path.relpath(target, path.parent))


def _files(directory: Path, values: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in values.items():
        (directory / name).write_text(f"{value}\n")


def _function(root: Path, path: Path, pci: str, vendor: str, device: str, klass: str, driver: str) -> None:
    _files(path, {"vendor": vendor, "device": device, "class": klass})
    drivers = root / "sys/bus/pci/drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    _link(path / "driver", drivers)
    _link(root / "sys/bus/pci/devices" / pci, path)
    write_aer_stats(path)


def write_aer_stats(function: Path, correctable: int = 0, nonfatal: int = 0, fatal: int = 0) -> None:
    """A PCI function's AER statistics as the kernel prints them (``aer_dev_*``): every named error
    with its count, then the TOTAL line; the counts land on ``RxErr`` and ``CmpltTO``."""
    named = {"correctable": ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr",
                             "HeaderOF"),
             "uncorrectable": ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt",
                               "RxOF", "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP",
                               "AtomicOpBlocked", "TLPBlockedErr", "PoisonTLPBlocked")}
    for file_name, names, first, count, total in (
            ("aer_dev_correctable", named["correctable"], "RxErr", correctable, "ERR_COR"),
            ("aer_dev_nonfatal", named["uncorrectable"], "CmpltTO", nonfatal, "ERR_NONFATAL"),
            ("aer_dev_fatal", named["uncorrectable"], "CmpltTO", fatal, "ERR_FATAL")):
        lines = [f"{name} {count if name == first else 0}" for name in names] + [f"TOTAL_{total} {count}"]
        (function / file_name).write_text("\n".join(lines) + "\n", encoding="ascii")


def _counter_values(seed: int, names: tuple[str, ...]) -> dict[str, int]:
    """Healthy, distinct values: traffic large (64-bit, below 2**62 so 4x fits), errors small."""
    values = {}
    for i, name in enumerate(names):
        if "data" in name:
            values[name] = 3_000_000_000_000 + seed * 1_000_003 + i
        elif "packets" in name or name.startswith(("rx_", "np_", "rp_")) or name == "port_xmit_wait":
            values[name] = 90_000_000 + seed * 7_919 + i
        else:
            values[name] = (seed + i) % 3
    return values


def _rdma_device(root: Path, function: Path, name: str, port: Port, rate: str, seed: int,
                 legacy: bool) -> None:
    device = function / "infiniband" / name
    _files(device, {"board_id": "MT_0000000838" if port.link_layer == "InfiniBand" else "MT_0000000834",
                    "fw_ver": "28.39.1002", "hca_type": "MT4129", "node_guid": f"a088:c203:00{seed:02x}:5e2a",
                    "node_type": "1: CA"})
    _link(device / "device", function)
    _link(root / "sys/class/infiniband" / name, device)
    ports = device / "ports" / "1"
    _files(ports, {"state": ACTIVE, "phys_state": LINK_UP, "rate": rate, "link_layer": port.link_layer,
                   "lid": f"0x{seed + 1:x}", "sm_lid": "0x1", "cap_mask": "0xa751e848"})
    _files(ports / "counters", _counter_values(seed, IB_COUNTERS))
    hw = HW_COUNTERS_IB if port.link_layer == "InfiniBand" else HW_COUNTERS_ROCE
    _files(ports / "hw_counters", {**_counter_values(seed, hw), "lifespan": 10})
    if legacy:
        _files(ports / "counters_ext", _counter_values(seed + 100, LEGACY_COUNTERS))
    net = function / "net" / port.netdev
    _files(net, {"dev_port": int(port.pci[-1]) if port.link_layer == "Ethernet" else 0, "mtu": 4092})


def build_rdma_tree(root: Path) -> RdmaTree:
    """Write the node's tree under ``root``; see the module docstring."""
    ports: list[Port] = []
    (root / "sys/class/infiniband").mkdir(parents=True, exist_ok=True)
    # Each GPU and its NIC: root port <bus>:01.0, switch upstream <bus+1>:00.0, downstream ports
    # <bus+2>:00.0 (NIC at <bus+3>) and <bus+2>:01.0 (GPU at <bus+4>).
    for i, bus in enumerate((0x08, 0x18, 0x38, 0x48, 0x88, 0x98, 0xb8, 0xc8)):
        domain = f"0000:{bus:02x}"
        top = root / "sys/devices" / f"pci{domain}" / f"{domain}:01.0" / f"0000:{bus + 1:02x}:00.0"
        nic_pci, gpu_pci = f"0000:{bus + 3:02x}:00.0", f"0000:{bus + 4:02x}:00.0"
        nic = top / f"0000:{bus + 2:02x}:00.0" / nic_pci
        gpu = top / f"0000:{bus + 2:02x}:01.0" / gpu_pci
        _function(root, gpu, gpu_pci, "0x10de", "0x2330", "0x030200", "nvidia")
        _function(root, nic, nic_pci, "0x15b3", "0x1021", "0x020700", "mlx5_core")
        port = Port(f"mlx5_{i}", nic_pci, "InfiniBand", f"ibp{bus + 3}s0", gpu_pci)
        _rdma_device(root, nic, port.device, port, NDR, i, legacy=(i == 7))
        ports.append(port)
    storage = root / "sys/devices/pci0000:a0/0000:a0:03.0"
    for fn in (0, 1):
        pci = f"0000:a1:00.{fn}"
        function = storage / pci
        _function(root, function, pci, "0x15b3", "0x1021", "0x020000", "mlx5_core")
        port = Port(f"mlx5_{8 + fn}", pci, "Ethernet", f"enp161s0f{fn}np{fn}")
        _rdma_device(root, function, port.device, port, HDR, 8 + fn, legacy=False)
        ports.append(port)
    return RdmaTree(root, tuple(ports))
