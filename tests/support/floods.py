"""Kernel-log floods for the storm benchmark and the reliability suite.

A flood is what a node's log looks like when something spams it (a NIC driver in a loop, audit
records, a stuck kernel thread): a million ordinary lines, with XIDs sprinkled in among them. The
records are real /dev/kmsg format (``healthagent.demo.node.kmsg_record``), numbered on from the
log's last sequence number, and the XID lines are the driver's own words
(``healthagent.demo.node.XID_MESSAGES``), so a flood appended to the demo node's ``dev/kmsg`` is
read exactly as the real device's records would be.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from healthagent.demo.node import XID_MESSAGES, kmsg_record
from tests.support.live_agent import AgentProcess, write_kubeconfig

# Lines a flooding kernel writes; none of them mentions an XID or a GPU falling off the bus.
NOISE = (
    "audit: type=1400 audit({t}.{n:03d}:{n}): apparmor=\"DENIED\" operation=\"open\" profile=\"cri-containerd."
    "apparmor.d\" name=\"/proc/{n}/status\" pid={n} comm=\"python\" requested_mask=\"r\" denied_mask=\"r\"",
    "cni0: port {p}(veth{n:08x}) entered blocking state",
    "ena 0000:27:00.0 eth0: TX hang detected on queue {p}, resetting (seq {n})",
    "nvme nvme0: I/O {n} QID {p} timeout, completion polled",
    "EXT4-fs warning (device nvme1n1): ext4_dx_add_entry:2511: Directory (ino: {n}) index full, "
    "reach max htree level :2",
)
XIDS_IN_FLOODS = (13, 31, 43, 45, 63, 74, 94, 95)  # catalogued XIDs of every action class


@dataclass(frozen=True)
class Flood:
    lines: int
    xids: int  # XID records among them
    by_xid: dict[int, int]


def last_seq(kernel_log: Path) -> int:
    """The sequence number of the last record in a /dev/kmsg-format file (-1 if none)."""
    with open(kernel_log, "rb") as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65536))
        tail = fh.read().decode("utf-8", "replace")
    for line in reversed(tail.splitlines()):
        if line and not line.startswith(" ") and ";" in line:
            return int(line.split(",", 2)[1])
    return -1


def flood_records(first_seq: int, lines: int, xid_every: int, gpu_pci: list[str],
                  usec: int = 7_300_000_000) -> Iterator[tuple[str, int | None]]:
    """(record text, XID or None) for ``lines`` records; every ``xid_every``-th is an XID."""
    for n in range(lines):
        seq = first_seq + n
        stamp = usec + n * 7
        if xid_every and n % xid_every == xid_every // 2:
            xid = XIDS_IN_FLOODS[(n // xid_every) % len(XIDS_IN_FLOODS)]
            pci = gpu_pci[(n // xid_every) % len(gpu_pci)].rsplit(".", 1)[0]
            text = f"NVRM: Xid (PCI:{pci}): {xid}, pid={40000 + n % 9000}, name=python, {XID_MESSAGES[xid]}"
            yield kmsg_record(4, seq, stamp, text), xid
        else:
            noise = NOISE[n % len(NOISE)].format(t=1718300000 + n // 1000, n=n, p=n % 16)
            yield kmsg_record(6, seq, stamp, noise), None


def append_flood(kernel_log: Path, gpu_pci: list[str], lines: int = 1_000_000, xid_every: int = 1000,
                 chunk_lines: int = 20_000) -> Flood:
    """Append a flood to a /dev/kmsg-format file in whole-record writes; returns what it holds."""
    by_xid: dict[int, int] = {}
    chunk: list[str] = []
    fd = os.open(kernel_log, os.O_WRONLY | os.O_APPEND)
    try:
        for record, xid in flood_records(last_seq(kernel_log) + 1, lines, xid_every, gpu_pci):
            chunk.append(record)
            if xid is not None:
                by_xid[xid] = by_xid.get(xid, 0) + 1
            if len(chunk) >= chunk_lines:
                _write_all(fd, "".join(chunk).encode("utf-8"))
                chunk = []
        if chunk:
            _write_all(fd, "".join(chunk).encode("utf-8"))
    finally:
        os.close(fd)
    return Flood(lines=lines, xids=sum(by_xid.values()), by_xid=by_xid)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append_xid_storm(kernel_log: Path, gpu_pci: str, xid: int = 13, lines: int = 1_000_000,
                     then: int | None = 94, chunk_lines: int = 20_000) -> Flood:
    """Append ``lines`` records of one XID on one GPU (a GPU or an application in a fault loop: the
    driver logs every one), then one record of XID ``then`` on the same GPU; /dev/kmsg records as
    the real device gives them, each with its own pid and the driver's words."""
    pci = gpu_pci.rsplit(".", 1)[0]
    first = last_seq(kernel_log) + 1
    fd = os.open(kernel_log, os.O_WRONLY | os.O_APPEND)
    try:
        chunk: list[str] = []
        for n in range(lines):
            chunk.append(kmsg_record(4, first + n, 7_300_000_000 + n * 7,
                                     f"NVRM: Xid (PCI:{pci}): {xid}, pid={40000 + n % 9000}, name=python, "
                                     f"{XID_MESSAGES[xid]}"))
            if len(chunk) >= chunk_lines:
                _write_all(fd, "".join(chunk).encode("utf-8"))
                chunk = []
        if then is not None:
            chunk.append(kmsg_record(4, first + lines, 7_300_000_000 + lines * 7,
                                     f"NVRM: Xid (PCI:{pci}): {then}, pid=1, name=python, {XID_MESSAGES[then]}"))
        _write_all(fd, "".join(chunk).encode("utf-8"))
    finally:
        os.close(fd)
    by_xid = {xid: lines}
    if then is not None:
        by_xid[then] = by_xid.get(then, 0) + 1
    return Flood(lines=lines + (then is not None), xids=sum(by_xid.values()), by_xid=by_xid)


def warm_flood_agent(demo, kube_url: str, node: str, tmp_path: Path, stub_cache: Path) -> AgentProcess:
    """``healthagent run`` on the demo node without NVML, writing to the API server at ``kube_url``,
    once it reached the server and read its 32 EFA devices: the agent both flood tests drive."""
    agent = AgentProcess(dict(host_root=demo.root, kube="kubeconfig", node_name=node,
                              kubeconfig=write_kubeconfig(kube_url, tmp_path / "kubeconfig"),
                              state_file=tmp_path / "state.json", expected_efa_devices=32, no_nvml=True),
                         tmp_path / "agent.log", env={"XDG_CACHE_HOME": str(stub_cache)})
    try:
        agent.wait_metric(lambda s: s.value("healthagent_kube_reachable") == 1
                          and s.value("healthagent_efa_devices") == 32, what="a warm agent")
    except BaseException:
        agent.close()
        raise
    return agent
