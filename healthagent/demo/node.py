"""The bundled demo node: a host root shaped like an AWS p5.48xlarge, written to a directory.

``healthagent demo``, ``check --host-root <dir>`` and the tests read it exactly as they read a
real node, through ``--host-root``; nothing in the agent knows it is a demo. The NVML scenario
file at its root is what the stub library answers from, once the demo or a test has put the stub
in NVML's place (``stub_setup.py``); the agent never does that itself.

What is written (paths under the root):
- ``sys/``: 32 EFA devices named as rdma-core's persistent naming does (``rdmap79s0``), each an
  ``infiniband/<dev>`` directory under its PCI function, with the same *relative* symlinks a real
  sysfs has (``class/infiniband/<dev> -> ../../devices/...``, ``device -> ../../../0000:4f:00.0``,
  ``driver -> ../../../bus/pci/drivers/efa``), every device and port counter file the current EFA
  driver exposes with plausible volumes after two hours of training traffic and zero error
  counters, ``lifespan`` (``10``, a cache setting, not a counter) and the hard-coded port
  ``state``/``phys_state``. The PCI buses follow a p5's layout: four EFAs just below each GPU.
- ``dev/kmsg``: a regular file in /dev/kmsg record format (``PRI,SEQ,USEC,FLAGS;text`` plus the
  `` KEY=value`` dictionary lines the kernel attaches to device messages) holding a boot log:
  PCI enumeration of the GPUs and EFAs, the NVIDIA driver loading, no XIDs (``boot_log.py``).
- ``proc/sys/kernel/random/boot_id``, ``proc/uptime`` and ``proc/stat`` (with ``btime``), so
  record times (boot time + USEC) line up with the wall clock.
- ``sys/devices/virtual/dmi/id/product_name``: ``p5.48xlarge``, as a Nitro instance's firmware
  says, so the agent expects 8 GPUs and 32 EFA devices without any setting.
- ``nvml-scenario.json``: a copy of the stub NVML library's bundled 8 x H100 scenario.

``write_demo_node`` writes what every demo node has around its fabric (the scenario, the kernel
log, ``proc/``, the product name); the InfiniBand node (``ib_node.py``) is built on it too.

``DemoNode`` then changes the node the way faults do: ``inject_xid`` appends the records the
NVIDIA driver writes for an XID (and/or tells the stub NVML library), ``bump_efa_counter`` moves
a driver counter, ``remove_efa_device`` makes a device vanish as a driver unbind does. Counter
files are replaced atomically (write elsewhere, rename) so a concurrent reader never sees a
half-written value.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from healthagent.demo import stub_nvml
from healthagent.demo.boot_log import Line, kmsg_record, kmsg_text, p5_boot_log
from healthagent.demo.rdma_tree import write_aer_stats
from healthagent.model import canonical_pci_bus_id
from healthagent.sources.instance import PRODUCT_NAME

# Counter files of the amzn EFA driver by scope, as amzn-drivers' efa_verbs.c names them.
EFA_PORT_COUNTERS: tuple[str, ...] = (
    "tx_bytes", "tx_pkts", "rx_bytes", "rx_pkts", "rx_drops",
    "send_bytes", "send_wrs", "recv_bytes", "recv_wrs",
    "rdma_read_wrs", "rdma_read_bytes", "rdma_read_wr_err", "rdma_read_resp_bytes",
    "rdma_write_wrs", "rdma_write_bytes", "rdma_write_wr_err", "rdma_write_recv_bytes",
    "retrans_bytes", "retrans_pkts", "retrans_timeout_events",
    "unresponsive_remote_events", "impaired_remote_conn_events",
)
EFA_DEVICE_COUNTERS: tuple[str, ...] = (
    "submitted_cmds", "completed_cmds", "cmds_err", "no_completion_cmds", "keep_alive_rcvd",
    "alloc_pd_err", "create_qp_err", "create_cq_err", "reg_mr_err", "alloc_ucontext_err",
    "create_ah_err", "mmap_err", "alloc_mr_err", "get_dma_mr_err",
)
LIFESPAN_MS = "10"
EFA_PORT_STATE = "4: ACTIVE"
EFA_PHYS_STATE = "5: LinkUp"
EFA_VENDOR = "0x1d0f"
EFA_DEVICE_ID = "0xefa2"
NVIDIA_VENDOR = "0x10de"
H100_SXM_DEVICE_ID = "0x2330"

# A p5.48xlarge's GPU PCI buses; its 32 EFAs sit on the four buses just below each GPU's.
P5_GPU_BUSES: tuple[int, ...] = (0x53, 0x64, 0x75, 0x86, 0x97, 0xA8, 0xB9, 0xCA)
P5_EFA_BUSES: tuple[int, ...] = tuple(bus - k for bus in P5_GPU_BUSES for k in (4, 3, 2, 1))

SCENARIO_FILE = "nvml-scenario.json"
INSTANCE_TYPE = "p5.48xlarge"  # its row in healthagent/policy/instance_types.csv: 8 GPUs, 32 EFA
KERNEL_LOG = "dev/kmsg"
DEFAULT_DRIVER_VERSION = "535.183.01"
UPTIME_SECONDS = 7245.31  # the demo node booted two hours before the demo starts
_TMP_DIR = ".demo-tmp"  # for atomic replaces; outside sys/ so no reader ever lists a temp file

# What the NVIDIA driver writes after "NVRM: Xid (PCI:...): N, pid=..., name=..., " per XID.
XID_MESSAGES: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_2 faulted @ "
        "0x7f2a_1c000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000010",
    45: "Ch 00000010",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at "
        "partition 6, subpartition 0.",
    61: "Internal micro-controller breakpoint/warning (0x0004)",
    62: "Internal micro-controller halt (0x0004)",
    63: "Row Remapper: New row (0x00000000004ea3c1) is marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to remap row (0x00000000004ea3c1), error 0x1, remapping failed.",
    74: "NVLink: fatal error detected on link 5(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate detected",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    109: "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x1c038",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
         "(GSP_RM_CONTROL) (0x20800a4c 0x4).",
    120: "GSP task exception: (reason 0x1c, task 0x2, PC 0x2d38e4)",
}
# XIDs the driver logs outside any process context.
_XIDS_WITHOUT_PROCESS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 95, 119, 120})


# -- sysfs ----------------------------------------------------------------------------------------

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="ascii")


def _symlink(link: Path, target: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def pci_function_dir(root: Path, pci_bus_id: str) -> Path:
    """Where sysfs keeps a PCI function: ``sys/devices/pci<domain>:<bus>/<id>`` (one bridge level)."""
    domain, bus = pci_bus_id.split(":")[:2]
    return root / "sys" / "devices" / f"pci{domain}:{bus}" / pci_bus_id


def write_pci_function(root: Path, pci_bus_id: str, *, vendor: str, device_id: str, driver: str,
                       class_code: str) -> Path:
    """A PCI function bound to ``driver``, with the relative ``driver`` link a real sysfs has."""
    function = pci_function_dir(root, pci_bus_id)
    _write(function / "vendor", vendor + "\n")
    _write(function / "device", device_id + "\n")
    _write(function / "class", class_code + "\n")
    (root / "sys" / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    _symlink(function / "driver", f"../../../bus/pci/drivers/{driver}")
    write_aer_stats(function)
    return function


def write_rdma_device(
    root: Path,
    name: str,
    pci_bus_id: str,
    *,
    device_counters: Mapping[str, str | int],
    port_counters: Mapping[str, str | int],
    vendor: str = EFA_VENDOR,
    device_id: str = EFA_DEVICE_ID,
    driver: str = "efa",
    ports: Iterable[int] = (1,),
    port_state: str = EFA_PORT_STATE,
    phys_state: str = EFA_PHYS_STATE,
) -> Path:
    """One ``/sys/class/infiniband/<name>`` device (EFA by default) under its PCI function.

    Counter values are written verbatim (``str``) or as decimal text (``int``), so tests can plant
    garbage. Returns the device directory (the class link's target).
    """
    function = pci_function_dir(root, pci_bus_id)
    if not function.exists():
        write_pci_function(root, pci_bus_id, vendor=vendor, device_id=device_id, driver=driver,
                           class_code="0x020000")
    device = function / "infiniband" / name
    _symlink(device / "device", f"../../../{pci_bus_id}")
    _write(device / "node_type", "1: CA\n")
    _write_counters(device / "hw_counters", device_counters)
    for port in ports:
        port_dir = device / "ports" / str(port)
        _write(port_dir / "state", port_state + "\n")
        _write(port_dir / "phys_state", phys_state + "\n")
        _write_counters(port_dir / "hw_counters", port_counters)
    domain_bus = f"pci{':'.join(pci_bus_id.split(':')[:2])}"
    _symlink(root / "sys" / "class" / "infiniband" / name,
             f"../../devices/{domain_bus}/{pci_bus_id}/infiniband/{name}")
    return device


def _write_counters(directory: Path, counters: Mapping[str, str | int]) -> None:
    """One small file per counter; raw os calls because a demo root is ~1,400 of them."""
    directory.mkdir(parents=True, exist_ok=True)
    for counter, value in counters.items():
        text = value if isinstance(value, str) else f"{value}\n"
        fd = os.open(directory / counter, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o444)
        try:
            os.write(fd, text.encode("ascii"))
        finally:
            os.close(fd)


def efa_device_name(pci_bus_id: str) -> str:
    """rdma-core's persistent name for a PCI RDMA device: ``rdmap<bus>s<slot>`` in decimal."""
    _, bus, dev_fn = pci_bus_id.split(":")
    return f"rdmap{int(bus, 16)}s{int(dev_fn.split('.')[0], 16)}"


def healthy_efa_counters(seed: int, uptime_seconds: float) -> tuple[dict[str, int], dict[str, int]]:
    """(device, port) counters of an EFA after ``uptime_seconds`` of NCCL traffic: large volumes,
    every error counter 0. Deterministic per ``seed`` so demo output is reproducible."""
    rng = random.Random(seed)
    busy = uptime_seconds * 0.8  # seconds of it spent in collectives
    write_bytes = int(busy * rng.uniform(2.6e9, 3.1e9))
    read_bytes = int(busy * rng.uniform(1.0e7, 2.0e7))
    send_bytes = int(busy * rng.uniform(3.5e7, 5.0e7))
    recv_bytes = int(send_bytes * rng.uniform(0.97, 1.03))
    write_recv = int(write_bytes * rng.uniform(0.97, 1.03))
    tx_bytes = write_bytes + send_bytes + read_bytes + int(write_bytes * 0.004)
    rx_bytes = write_recv + recv_bytes + read_bytes + int(write_recv * 0.004)
    port = dict.fromkeys(EFA_PORT_COUNTERS, 0)
    port.update(
        tx_bytes=tx_bytes, tx_pkts=tx_bytes // 8192, rx_bytes=rx_bytes, rx_pkts=rx_bytes // 8192,
        send_bytes=send_bytes, send_wrs=send_bytes // 4096, recv_bytes=recv_bytes,
        recv_wrs=recv_bytes // 4096, rdma_read_bytes=read_bytes, rdma_read_wrs=read_bytes // 262144,
        rdma_read_resp_bytes=int(read_bytes * rng.uniform(0.98, 1.02)),
        rdma_write_bytes=write_bytes, rdma_write_wrs=write_bytes // 1048576,
        rdma_write_recv_bytes=write_recv,
    )
    submitted = int(uptime_seconds * 7) + rng.randrange(100, 900)
    device = dict.fromkeys(EFA_DEVICE_COUNTERS, 0)
    device.update(submitted_cmds=submitted, completed_cmds=submitted,
                  keep_alive_rcvd=int(uptime_seconds) - rng.randrange(0, 5))
    return device, port


def write_efa_devices(root: Path, pci_bus_ids: Iterable[str], uptime_seconds: float = UPTIME_SECONDS) -> list[str]:
    """Healthy EFA devices (every counter file, ``lifespan``, port state) at these PCI ids; names."""
    names = []
    for seed, pci in enumerate(pci_bus_ids):
        name = efa_device_name(pci)
        device_counters, port_counters = healthy_efa_counters(seed, uptime_seconds)
        write_rdma_device(root, name, pci,
                          device_counters={**device_counters, "lifespan": LIFESPAN_MS + "\n"},
                          port_counters={**port_counters, "lifespan": LIFESPAN_MS + "\n"})
        names.append(name)
    return names


def p5_efa_pci_bus_ids() -> list[str]:
    return [f"0000:{bus:02x}:00.0" for bus in P5_EFA_BUSES]


def _counter_files(device_dir: Path, counter: str) -> list[Path]:
    candidates = [device_dir / "hw_counters" / counter]
    ports = device_dir / "ports"
    if ports.is_dir():
        candidates += [port / "hw_counters" / counter for port in sorted(ports.iterdir())]
    return [path for path in candidates if path.is_file()]


# -- the kernel log -------------------------------------------------------------------------------

def _xid_pci(pci_bus_id: str) -> str:
    """The driver's form of a GPU's PCI id in XID lines: ``0000:53:00`` (no function)."""
    return pci_bus_id.rsplit(".", 1)[0]


# -- the node -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DemoNode:
    """A built demo host root and the fault injections tests and the demo script use."""

    root: Path
    efa_devices: list[str]  # as built: the instance type's inventory, not "what is there now"
    gpu_pci_bus_ids: list[str]  # canonical, by GPU index
    gpu_uuids: list[str]
    kernel_log: Path
    scenario: Path
    boot_id: str
    uptime_at_build: float
    built_at: float  # wall clock when written; uptime advances with it

    # -- kernel log / NVML ---------------------------------------------------------------------

    def inject_xid(self, gpu: int, xid: int, via: str = "kmsg") -> str:
        """Report XID ``xid`` on GPU index ``gpu`` the way the driver does.

        ``via="kmsg"`` appends the kernel-log records (preceded, the first time a GPU has an XID,
        by the driver's ``NVRM: GPU at PCI:...`` and serial-number lines); ``via="nvml"`` delivers
        the event through the stub NVML library; ``via="both"`` does both, as a real driver does.
        Returns the XID record's text ("" for nvml only).
        """
        if via not in ("kmsg", "nvml", "both"):
            raise ValueError(f"via={via!r}: use kmsg, nvml or both")
        if not 0 <= gpu < len(self.gpu_pci_bus_ids):
            raise IndexError(f"GPU {gpu} does not exist on this node (0..{len(self.gpu_pci_bus_ids) - 1})")
        text = ""
        if via in ("kmsg", "both"):
            text = self._append_xid_records(gpu, xid)
        if via in ("nvml", "both"):
            stub_nvml.inject_xid(self.scenario, gpu, xid)
        return text

    def log_kernel(self, priority: int, text: str, fields: Mapping[str, str] | None = None) -> None:
        """Append one kernel-log record as the kernel writes it now: numbered after the last record,
        stamped like ``inject_xid``'s (a driver's line the demo's fault makes, beside the XIDs)."""
        seq = _last_seq(self.kernel_log.read_text(encoding="utf-8")) + 1
        _append(self.kernel_log, kmsg_record(priority, seq, self._now_usec(), text, fields))

    def _now_usec(self) -> int:
        # Stamped on this machine's monotonic clock, as the kernel stamps /dev/kmsg: the agent reads
        # a record's stamp on the clock it stamps NVML's events with (healthagent/clock.py).
        return max(int(time.monotonic() * 1_000_000), int(self.uptime_at_build * 1_000_000))

    def _append_xid_records(self, gpu: int, xid: int) -> str:
        pci = _xid_pci(self.gpu_pci_bus_ids[gpu])
        existing = self.kernel_log.read_text(encoding="utf-8")
        seq = _last_seq(existing) + 1
        usec = self._now_usec()
        records = []
        if f"NVRM: GPU at PCI:{pci}:" not in existing:
            records.append(kmsg_record(4, seq, usec, f"NVRM: GPU at PCI:{pci}: {self.gpu_uuids[gpu]}"))
            records.append(kmsg_record(4, seq + 1, usec, f"NVRM: GPU Board Serial Number: "
                                                          f"{1654923000000 + gpu * 7919}"))
            seq += 2
        if xid in _XIDS_WITHOUT_PROCESS:
            who = "pid='<unknown>', name=<unknown>"
        else:
            who = f"pid={48210 + gpu * 16}, name=python"
        text = f"NVRM: Xid (PCI:{pci}): {xid}, {who}, " + XID_MESSAGES.get(
            xid, "Unrecognized error, see the NVIDIA XID catalog")
        records.append(kmsg_record(4, seq, usec, text))
        _append(self.kernel_log, "".join(records))
        return text

    # -- EFA -------------------------------------------------------------------------------------

    def efa_device_dir(self, device: str) -> Path:
        return (self.root / "sys" / "class" / "infiniband" / device).resolve()

    def bump_efa_counter(self, device: str, counter: str, delta: int) -> int:
        """Add ``delta`` to a driver counter of ``device`` (in every directory that has the file, as
        the old combined layout does) and return its new value."""
        files = _counter_files(self.efa_device_dir(device), counter)
        if not files:
            raise KeyError(f"{device} has no counter {counter!r}")
        value = 0
        for path in files:
            value = int(path.read_text(encoding="ascii").strip()) + delta
            self._replace(path, f"{value}\n")
        return value

    def remove_efa_device(self, device: str) -> None:
        """Make ``device`` vanish as a driver unbind does: the class link and the device go."""
        link = self.root / "sys" / "class" / "infiniband" / device
        target = self.efa_device_dir(device)
        link.unlink()
        shutil.rmtree(target)

    def _replace(self, path: Path, text: str) -> None:
        tmp_dir = self.root / _TMP_DIR
        tmp_dir.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=tmp_dir)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(text)
        os.replace(tmp, path)


def _last_seq(log_text: str) -> int:
    for line in reversed(log_text.splitlines()):
        if line and not line.startswith(" ") and ";" in line:
            return int(line.split(",", 2)[1])
    return -1


def _append(path: Path, text: str) -> None:
    """Append whole records with one write, so a reader never sees half a record."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def _load_gpus(scenario: Path) -> tuple[list[dict], str]:
    """(GPUs by index with canonical ``pci_bus_id`` and ``uuid``, driver version) of a scenario."""
    data = json.loads(scenario.read_text(encoding="utf-8"))
    gpus = []
    for position, gpu in enumerate(data["gpus"]):
        pci = canonical_pci_bus_id(str(gpu.get("pci_bus_id") or gpu.get("pci_bus_id_legacy") or ""))
        if pci is None:
            raise ValueError(f"{scenario}: GPU {position} has no valid pci_bus_id")
        gpus.append({"index": int(gpu.get("index", position)), "pci_bus_id": pci,
                     "uuid": str(gpu.get("uuid", ""))})
    gpus.sort(key=lambda g: g["index"])
    driver = str(data.get("driver_version") or DEFAULT_DRIVER_VERSION)
    return gpus, driver


def build_demo_root(root: Path) -> DemoNode:
    """Write the demo host root, a p5.48xlarge, into ``root`` (created; must not already hold a
    demo node)."""
    root = Path(root).absolute()
    efa_pci_ids = p5_efa_pci_bus_ids()
    efa_devices = write_efa_devices(root, efa_pci_ids)
    # INSTANCE_TYPE: what a Nitro instance's firmware says; the agent reads its expected inventory from it.
    return write_demo_node(root, INSTANCE_TYPE, efa_devices,
                           lambda gpus, driver: p5_boot_log(gpus, efa_pci_ids, driver))


def write_demo_node(root: Path, product_name: str, efa_devices: list[str],
                    boot_log: Callable[[list[dict], str], list[Line]],
                    gpu_pci_bus_ids: Sequence[str] = ()) -> DemoNode:
    """What every demo node has around the fabric its caller wrote into ``root`` (``efa_devices``:
    the EFA devices among it): the NVML scenario (its GPUs at ``gpu_pci_bus_ids`` when given), the
    kernel log ``boot_log`` writes for those GPUs and driver version, the boot, and the firmware's
    product name."""
    root.mkdir(parents=True, exist_ok=True)
    built_at = time.time()
    # The demo kernel shares this machine's monotonic clock, as a node's kernel log does the
    # agent's: its uptime and boot time are this machine's.
    uptime = time.monotonic()

    scenario = root / SCENARIO_FILE
    stub_nvml.copy_demo_scenario(scenario, gpu_pci_bus_ids)
    gpus, driver_version = _load_gpus(scenario)

    kernel_log = root / KERNEL_LOG
    _write(kernel_log, kmsg_text(boot_log(gpus, driver_version)))
    boot_id = _write_boot(root, built_at, uptime)
    _write(root / PRODUCT_NAME.lstrip("/"), product_name + "\n")

    return DemoNode(
        root=root, efa_devices=efa_devices, gpu_pci_bus_ids=[g["pci_bus_id"] for g in gpus],
        gpu_uuids=[g["uuid"] for g in gpus], kernel_log=kernel_log, scenario=scenario,
        boot_id=boot_id, uptime_at_build=uptime, built_at=built_at,
    )


def _write_boot(root: Path, built_at: float, uptime: float) -> str:
    """A fresh boot id, ``proc/uptime`` and ``proc/stat`` (its ``btime``) of a node up ``uptime``
    seconds at wall time ``built_at``, so kernel-log record times line up with the wall clock."""
    boot_id = str(uuidlib.uuid4())
    _write(root / "proc" / "sys" / "kernel" / "random" / "boot_id", boot_id + "\n")
    _write(root / "proc" / "uptime", f"{uptime:.2f} {uptime * 180:.2f}\n")
    _write(root / "proc" / "stat", _proc_stat(int(built_at - uptime), uptime))
    return boot_id


def _proc_stat(btime: int, uptime: float) -> str:
    ticks = int(uptime * 100)
    user, system, idle = ticks * 61, ticks * 9, ticks * 118
    cpu = f"{user} 1204 {system} {idle} 3312 0 9123 0 0 0"
    lines = [f"cpu  {cpu}"]
    lines += [f"cpu{n} {user // 192} 6 {system // 192} {idle // 192} 17 0 47 0 0 0" for n in range(192)]
    lines += [
        "intr 4912334712 0 9 0 0 0 0 0 0 0 0 0 0 156 0 0 0",
        "ctxt 9812231190",
        f"btime {btime}",
        "processes 412877",
        "procs_running 97",
        "procs_blocked 0",
        "softirq 2211904566 12 412390877 1203 381920011 4410 0 8832102 901238771 117 506739033",
    ]
    return "\n".join(lines) + "\n"
