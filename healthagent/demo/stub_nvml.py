"""Build, load and drive the stub ``libnvidia-ml.so.1`` (``stub_nvml.c``) that stands in for a GPU.

The stub is a fake driver for tests, the demo and benchmarks: the real ``nvidia-ml-py`` bindings
call it through their real ctypes structures, and it answers from a JSON scenario file
(``HEALTHAGENT_STUB_NVML_SCENARIO``) that it re-reads whenever the file changes. The helpers here
change that file the way a failing node would change a real driver's answers: an XID event, a GPU
that falls off the bus, a GPU gone from the count, any counter.

Writes are atomic (temp file + rename) so the C reader never sees half a file, and each write moves
the file's mtime strictly forward, because two writes inside one kernel timer tick would otherwise
look identical to the stub's (inode, size, mtime) change check.

Scenario format (JSON; the stub rejects unknown keys and wrong types, keys starting "_" are comments):
``{"driver_version": str, "gpus": [GPU, ...], "events": [EVENT, ...]}``. A GPU needs ``uuid``,
``name`` and ``pci_bus_id`` (NVML form ``00000000:53:00.0``); the rest default to 0/false:
``ecc_{volatile,aggregate}_{corrected,uncorrected}``, ``remapped_rows_{correctable,uncorrectable}``,
``remap_pending``, ``remap_failure``, ``retired_pages_{single_bit,double_bit}`` (counts),
``retired_pages_pending``, ``clocks_event_reasons`` (nvmlClocksEventReason bits), ``nvlink_links``,
``nvlink_inactive`` (link numbers), ``nvlink_{replay,recovery,crc_flit,crc_data,ecc_data}`` (per-link
lists), ``pcie_replay``, ``temperature_c``, ``power_mw`` (NVML reports milliwatts),
``supported_events`` (nvmlEventType bits), ``mig_mode``, ``lost`` (every call answers GPU_IS_LOST),
``not_supported`` (NVML function names that answer NOT_SUPPORTED). An EVENT is ``{"id": unique > 0,
"gpu": index, "type": "xid"|"sbe"|"dbe", "data": the XID, "gpu_instance"?, "compute_instance"?}``;
an event set delivers, once, each event with an id above the largest present when it was created.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pynvml

from healthagent.common import atomic_write

SCENARIO_ENV = "HEALTHAGENT_STUB_NVML_SCENARIO"
SONAME = "libnvidia-ml.so.1"
STUB_SOURCE = Path(__file__).with_name("stub_nvml.c")
DEMO_SCENARIO = Path(__file__).with_name("nvml-h100x8.json")
COMPILE_FLAGS = ("-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden",
                 f"-Wl,-soname,{SONAME}", "-pthread")
COMPILE_TIMEOUT_SECONDS = 120

# Keys a scenario GPU may carry (stub_nvml.c rejects any other key). Counters are integers, flags
# booleans; nvlink_* counters are per-link lists; not_supported lists NVML function names.
GPU_FIELDS = frozenset({
    "uuid", "name", "pci_bus_id", "pci_device_id", "pci_subsystem_id", "lost", "not_supported",
    "ecc_volatile_corrected", "ecc_volatile_uncorrected", "ecc_aggregate_corrected",
    "ecc_aggregate_uncorrected", "remapped_rows_correctable", "remapped_rows_uncorrectable",
    "remap_pending", "remap_failure", "retired_pages_single_bit", "retired_pages_double_bit",
    "retired_pages_pending", "clocks_event_reasons", "nvlink_links", "nvlink_inactive",
    "nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data", "nvlink_ecc_data",
    "pcie_replay", "temperature_c", "power_mw", "supported_events", "mig_mode",
})
# NVML event types a scenario event can carry (nvmlEventType* bits, by the stub's names).
EVENT_TYPES = ("xid", "sbe", "dbe")


class StubBuildError(RuntimeError):
    """The stub library could not be compiled; the message says what to install or fix."""


def build_stub(cache_dir: Path) -> Path:
    """Compile ``stub_nvml.c`` once per source hash into ``cache_dir`` and return the library path.

    The library lands in its own folder as ``libnvidia-ml.so.1``, so that folder can also go on
    ``LD_LIBRARY_PATH``. Concurrent builders are safe: each compiles to a temp name and renames.
    """
    source = STUB_SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join(COMPILE_FLAGS).encode()).hexdigest()[:16]
    target = Path(cache_dir) / f"stub-nvml-{digest}" / SONAME
    if target.is_file():
        return target
    compiler = shutil.which("cc")
    if compiler is None:
        raise StubBuildError("cc not found: install a C compiler (e.g. apt-get install gcc) to build the "
                             "stub libnvidia-ml.so.1 used by the demo and the tests")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *COMPILE_FLAGS, "-o", tmp_name, str(STUB_SOURCE)],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_SECONDS)
        if proc.returncode != 0:
            raise StubBuildError(f"cc failed to build {STUB_SOURCE.name} (exit {proc.returncode}): "
                                 f"{proc.stderr.strip()[-2000:]}")
        os.replace(tmp_name, target)
    except subprocess.TimeoutExpired:
        raise StubBuildError(f"cc did not finish building {STUB_SOURCE.name} in "
                             f"{COMPILE_TIMEOUT_SECONDS} s") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
    return target


def preload_stub(lib: Path) -> ctypes.CDLL:
    """Make the real pynvml use the stub; idempotent. Returns the library pynvml will call.

    pynvml loads ``CDLL("libnvidia-ml.so.1")`` on its first ``nvmlInit``; glibc's dlopen matches an
    already-loaded object by its DT_SONAME, so once the stub (soname ``libnvidia-ml.so.1``) is in the
    process pynvml would find it even on a host with a real driver. We also hand the handle to
    pynvml directly so nothing depends on search paths. If pynvml already holds a stub (built into
    another cache folder, say) that one is kept; if it holds a real NVML, RuntimeError: too late.
    """
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        if current is not None:
            if _is_stub(current):
                return current
            raise RuntimeError(f"pynvml already loaded a real NVML library ({current._name}); "
                               "preload the stub before the first nvmlInit")
        handle = ctypes.CDLL(str(lib))
        pynvml.nvmlLib = handle
        return handle


def _is_stub(library: ctypes.CDLL) -> bool:
    try:
        library.stubNvmlStats  # a symbol only the stub exports
    except AttributeError:
        return False
    return True


# -- scenario files ---------------------------------------------------------------------------------

def load_scenario(path: Path | str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_scenario(path: Path | str, data: dict[str, Any]) -> None:
    """Atomically replace the scenario with ``data`` (see ``write_scenario_text``)."""
    write_scenario_text(path, json.dumps(data, indent=1) + "\n")


def write_scenario_text(path: Path | str, text: str | bytes) -> None:
    """Atomically replace the scenario file: temp file in the same folder, fsync, mtime bump, rename.

    Takes raw text so tests can hand the stub a malformed file the same way a real write lands.
    """
    path = Path(path)
    payload = text.encode("utf-8") if isinstance(text, str) else text
    try:
        previous_ns = path.stat().st_mtime_ns
    except FileNotFoundError:
        previous_ns = 0
    atomic_write(path, payload, mtime_ns=max(time.time_ns(), previous_ns + 1), sync_dir=False)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise read-modify-write of one scenario between threads and processes (flock)."""
    lock_path = path.with_name(f".{path.name}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _mutate(path: Path | str, change: Callable[[dict[str, Any]], Any]) -> Any:
    path = Path(path)
    with _locked(path):
        data = load_scenario(path)
        result = change(data)
        write_scenario(path, data)
    return result


def _gpu(data: dict[str, Any], gpu_index: int) -> dict[str, Any]:
    gpus = data.get("gpus", [])
    if not 0 <= gpu_index < len(gpus):
        raise IndexError(f"gpu_index {gpu_index} out of range: the scenario has {len(gpus)} GPUs")
    return gpus[gpu_index]


def inject_xid(path: Path | str, gpu_index: int, xid: int, *, event_type: str = "xid",
               gpu_instance: int | None = None, compute_instance: int | None = None) -> int:
    """Append an NVML event (default: XID critical error ``xid``) on a GPU; returns its event id.

    Every event set that exists when the event is written delivers it once through
    ``nvmlEventSetWait_v2``. ``event_type`` "sbe"/"dbe" injects an ECC event instead (data = xid).
    """
    if event_type not in EVENT_TYPES:
        raise ValueError(f"event_type {event_type!r}; use one of: {', '.join(EVENT_TYPES)}")

    def change(data: dict[str, Any]) -> int:
        _gpu(data, gpu_index)
        events = data.setdefault("events", [])
        event_id = max((e["id"] for e in events), default=0) + 1
        event: dict[str, Any] = {"id": event_id, "gpu": gpu_index, "type": event_type, "data": int(xid)}
        if gpu_instance is not None:
            event["gpu_instance"] = gpu_instance
        if compute_instance is not None:
            event["compute_instance"] = compute_instance
        events.append(event)
        return event_id

    return _mutate(path, change)


def set_gpu_lost(path: Path | str, gpu_index: int, lost: bool = True) -> None:
    """Make every NVML call on this GPU answer GPU_IS_LOST (it fell off the bus), or undo it."""
    set_gpu_field(path, gpu_index, "lost", bool(lost))


def remove_gpu(path: Path | str, gpu_index: int) -> dict[str, Any]:
    """Take a GPU out of the device count (the others re-index, as NVML enumerates); returns it.

    Events of the removed GPU are dropped and later GPUs' events follow their new index.
    """
    def change(data: dict[str, Any]) -> dict[str, Any]:
        removed = _gpu(data, gpu_index)
        del data["gpus"][gpu_index]
        kept = []
        for event in data.get("events", []):
            if event["gpu"] == gpu_index:
                continue
            if event["gpu"] > gpu_index:
                event["gpu"] -= 1
            kept.append(event)
        data["events"] = kept
        return removed

    return _mutate(path, change)


def set_gpu_field(path: Path | str, gpu_index: int, field: str, value: Any) -> None:
    """Set one field of one GPU (a counter, a flag, ``not_supported``, ...); see ``GPU_FIELDS``."""
    if field not in GPU_FIELDS:
        raise ValueError(f"unknown GPU field {field!r}; use one of: {', '.join(sorted(GPU_FIELDS))}")

    def change(data: dict[str, Any]) -> None:
        _gpu(data, gpu_index)[field] = value

    _mutate(path, change)


def copy_demo_scenario(dest: Path | str, pci_bus_ids: Sequence[str] = ()) -> Path:
    """Write the bundled 8 x H100 scenario to ``dest`` (a file the caller may then mutate).

    ``pci_bus_ids`` (canonical, one per GPU, by index) put the GPUs where another make of node has
    them (a DGX H100's PCIe layout rather than a p5's), so NVML and the host's sysfs agree on
    which GPU sits behind which PCIe switch."""
    dest = Path(dest)
    data = load_scenario(DEMO_SCENARIO)
    if pci_bus_ids:
        if len(pci_bus_ids) != len(data["gpus"]):
            raise ValueError(f"{len(pci_bus_ids)} PCI ids for {len(data['gpus'])} GPUs")
        for gpu, pci in zip(data["gpus"], pci_bus_ids):
            domain, rest = pci.split(":", 1)
            gpu["pci_bus_id"] = f"{int(domain, 16):08X}:{rest.upper()}"  # as NVML prints it
        data["_comment"] = [*data.get("_comment", []), "GPUs placed at this host's PCI ids: " + ", ".join(pci_bus_ids)]
    write_scenario(dest, data)
    return dest
