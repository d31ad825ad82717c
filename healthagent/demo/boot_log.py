"""The kernel log a demo node booted with, in /dev/kmsg record format.

Each demo node starts with the log of an ordinary boot, so the agent's kernel-log source meets what
it meets on a node (the kernel's banner, PCI enumeration with the ``KEY=value`` dictionary lines
the kernel attaches to device messages, the NVIDIA driver loading) and the scripted XID lands after
it, not in an empty file. Two boots: a p5.48xlarge's (Amazon Linux 2, EFA) and a DGX H100's
(Ubuntu with NVIDIA's kernel, ConnectX-7 for InfiniBand and RoCE). Neither holds an XID.
"""

from __future__ import annotations

from typing import Iterable, Mapping

# (priority, seconds since boot, text, dictionary fields)
Line = tuple[int, float, str, dict]


def kmsg_record(priority: int, seq: int, usec: int, text: str, fields: Mapping[str, str] | None = None) -> str:
    """One /dev/kmsg record: ``PRI,SEQ,USEC,FLAGS;text`` and its `` KEY=value`` lines."""
    extra = "".join(f" {k}={v}\n" for k, v in (fields or {}).items())
    return f"{priority},{seq},{usec},-;{text}\n" + extra


def kmsg_text(lines: Iterable[Line]) -> str:
    """The records of ``lines``, numbered from 0 as a fresh boot's log is."""
    return "".join(kmsg_record(priority, seq, int(seconds * 1_000_000), text, fields)
                   for seq, (priority, seconds, text, fields) in enumerate(lines))


def _pci(pci: str) -> dict[str, str]:
    return {"SUBSYSTEM": "pci", "DEVICE": f"+pci:{pci}"}


def _enumeration(devices: Iterable[tuple[str, str, str]]) -> list[Line]:
    """The PCI core's line per function: (PCI id, ``vendor:device``, class code)."""
    return [(6, 1.31 + n * 0.000389, f"pci {pci}: [{ids}] type 00 class {class_code}", _pci(pci))
            for n, (pci, ids, class_code) in enumerate(devices)]


def _gpu_enumeration(gpus: list[dict]) -> list[tuple[str, str, str]]:
    return [(g["pci_bus_id"], "10de:2330", "0x030200") for g in gpus]


def _nvidia_driver(gpus: list[dict], driver_version: str) -> list[Line]:
    """The NVIDIA kernel modules loading (the same on every node with this driver)."""
    first_gpu = int(gpus[0]["pci_bus_id"].split(":")[1], 16) << 8 if gpus else 0
    return [
        (4, 7.104875, "nvidia: loading out-of-tree module taints kernel.", {}),
        (4, 7.104891, "nvidia: module license 'NVIDIA' taints kernel.", {}),
        (4, 7.104893, "Disabling lock debugging due to kernel taint", {}),
        (6, 7.212877, "nvidia-nvlink: Nvlink Core is being initialized, major device number 235", {}),
        (5, 7.530244, f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {driver_version}  "
                      "Wed Jun 12 22:31:55 UTC 2024", {}),
        (6, 7.861630, f"nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  "
                      f"{driver_version}  Wed Jun 12 21:50:46 UTC 2024", {}),
        (6, 7.902271, f"[drm] [nvidia-drm] [GPU ID 0x{first_gpu:08x}] Loading driver", {}),
        (6, 8.310044, "nvidia-uvm: Loaded the UVM driver, major device number 511.", {}),
    ]


def _nvidia_services() -> list[Line]:
    return [(5, 14.551902, _audit_unit_started("nvidia-persistenced", 14.551902), {}),
            (5, 15.001782, _audit_unit_started("nvidia-fabricmanager", 15.001782), {})]


def _audit_unit_started(unit: str, seconds: float) -> str:
    """systemd's audit record (logged through the kernel) for a service that started."""
    return (f"audit: type=1130 audit({1718300000 + seconds:.3f}:{200 + int(seconds)}): pid=1 uid=0 "
            f"auid=4294967295 ses=4294967295 msg='unit={unit} comm=\"systemd\" "
            f"exe=\"/usr/lib/systemd/systemd\" hostname=? addr=? terminal=? res=success'")


def _kernel_start(banner: str, command_line: str, dmi: str, cpus: int, memory: str,
                  devices: list[tuple[str, str, str]], hypervisor: str = "") -> list[Line]:
    """The kernel's first lines: its banner, command line, the firmware's name for the machine,
    CPUs, memory, and the PCI functions it enumerates (``_enumeration``)."""
    lines: list[Line] = [(5, 0.0, banner, {}), (6, 0.0, f"Command line: {command_line}", {}),
                         (6, 0.0, "BIOS-provided physical RAM map:", {}), (6, 0.0, f"DMI: {dmi}", {})]
    if hypervisor:
        lines.append((6, 0.000001, f"Hypervisor detected: {hypervisor}", {}))
    lines += [(6, 0.081112, f"smpboot: Allowing {cpus} CPUs, 0 hotplug CPUs", {}),
              (6, 0.231784, f"Memory: {memory}", {}),
              (6, 1.204731, "PCI: Using configuration type 1 for base access", {})]
    return lines + _enumeration(devices)


def p5_boot_log(gpus: list[dict], efa_pci_ids: list[str], driver_version: str) -> list[Line]:
    """A p5.48xlarge's ordinary boot, in order."""
    lines = _kernel_start(
        "Linux version 5.10.220-209.869.amzn2.x86_64 (mockbuild@ip-10-0-41-187) (gcc10-gcc (GCC) 10.5.0 "
        "20230707 (Red Hat 10.5.0-1), GNU ld version 2.35.2-9.amzn2.0.1) #1 SMP Wed Jul 17 18:14:27 UTC 2024",
        "BOOT_IMAGE=/boot/vmlinuz-5.10.220-209.869.amzn2.x86_64 root=UUID=1f0a5c1e-3b7a-4f43-9d1e-2b1f4a7c5e21 "
        "ro console=tty0 console=ttyS0,115200n8 nvme_core.io_timeout=4294967295 rd.emergency=poweroff rd.shell=0",
        "Amazon EC2 p5.48xlarge/, BIOS 1.0 10/16/2017", 192,
        "2113419876K/2147073760K available (12294K kernel code, 7714K rwdata)",
        _gpu_enumeration(gpus) + [(pci, "1d0f:efa2", "0x020000") for pci in efa_pci_ids], hypervisor="KVM")
    lines += [
        (6, 2.916003, "nvme nvme0: 32/0/0 default/read/poll queues", {}),
        (6, 3.402118, "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Opts: (null)", {}),
        (6, 5.887019, "systemd[1]: Started Journal Service.", {}),
        (6, 6.514462, "ena 0000:27:00.0 eth0: Elastic Network Adapter (ENA) v2.12.0g", {}),
        *_nvidia_driver(gpus, driver_version),
        (6, 9.120538, "Elastic Fabric Adapter (EFA) v2.10.0g", {}),
    ]
    for i, pci in enumerate(efa_pci_ids[:2]):
        lines.append((6, 9.121 + i * 0.04, f"efa {pci}: Setup irq:0x{0x48 + i * 2:x} name:efa-mgmnt@pci:{pci}",
                      _pci(pci)))
    lines += [
        *_nvidia_services(),
        (6, 31.772015, "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready", {}),
        (6, 42.108331, "cni0: port 1(veth3a1f2c07) entered forwarding state", {}),
    ]
    return lines


def dgx_boot_log(gpus: list[dict], nics: list[tuple[str, str, str]], driver_version: str) -> list[Line]:
    """A DGX H100's ordinary boot, in order. ``nics``: (PCI id, class code, network interface) of
    each ConnectX-7 function (``0x020700`` InfiniBand, ``0x020000`` Ethernet)."""
    kernel = "5.15.0-1063-nvidia"
    lines = _kernel_start(
        f"Linux version {kernel} (buildd@lcy02-amd64-034) (gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0, GNU ld "
        "(GNU Binutils for Ubuntu) 2.38) #64-Ubuntu SMP Wed Aug 21 13:45:13 UTC 2024 (Ubuntu 5.15.0-1063.64-nvidia "
        "5.15.158)",
        f"BOOT_IMAGE=/boot/vmlinuz-{kernel} root=UUID=8e1c6d2a-4f0b-4b7e-a3d5-5c9f2e7a1b40 ro console=tty0 "
        "console=ttyS1,115200n8 pci=realloc=off",
        "NVIDIA DGXH100/DGXH100, BIOS 1.5.0 01/25/2024", 224,
        "2113311244K/2147048296K available (16393K kernel code, 4380K rwdata)",
        _gpu_enumeration(gpus) + [(pci, "15b3:1021", klass) for pci, klass, _ in nics])
    lines += [
        (6, 2.884127, "nvme nvme0: 64/0/0 default/read/poll queues", {}),
        (6, 3.517760, "EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode. Opts: (null). "
                      "Quota mode: none.", {}),
        (6, 5.903355, "systemd[1]: Started Journal Service.", {}),
    ]
    for i, (pci, _, netdev) in enumerate(nics):
        at = 5.95 + i * 0.1  # the ten functions probe before the NVIDIA modules load
        was = f"ib{i}" if netdev.startswith("ib") else f"eth{i}"
        lines += [(6, at, f"mlx5_core {pci}: firmware version: 28.39.1002", _pci(pci)),
                  (6, at + 0.0004, f"mlx5_core {pci}: 252.048 Gb/s available PCIe bandwidth (16.0 GT/s PCIe "
                                   "x16 link)", _pci(pci)),
                  (6, at + 0.05, f"mlx5_core {pci} {netdev}: renamed from {was}", _pci(pci))]
    lines += _nvidia_driver(gpus, driver_version)
    lines += _nvidia_services()
    return lines
