"""The subprocess side of ``tests.support.nvml_stub.run_steps``: ``python -m
tests.support.nvml_driver PLAN`` runs each step of PLAN against the real pynvml bindings and
``NvmlSource`` (with the stub libnvidia-ml.so.1 preloaded) and prints one JSON list of results.

A module of its own, importing no test framework, because every NVML test starts a fresh
interpreter with it (pynvml's library state is module-global): what it imports, each of them pays.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


class _Driver:
    def __init__(self, lib: str | None, scenario: str | None, source_args: dict[str, Any]) -> None:
        from healthagent.demo import stub_nvml

        self.stub_nvml = stub_nvml
        self.scenario = Path(scenario) if scenario else None
        self.lib = stub_nvml.preload_stub(Path(lib)) if lib else None
        self.woken = threading.Event()
        self.events: list[Any] = []
        self._source_args = source_args
        self._source = None

    @property
    def source(self):
        if self._source is None:
            from healthagent.sources.nvml import NvmlSource

            args = dict(self._source_args)
            on_event = self._raise_on_event if args.pop("on_event_raises", False) else self.woken.set
            self._source = NvmlSource(on_event=on_event, **args)
        return self._source

    def _raise_on_event(self) -> None:
        self.woken.set()
        raise RuntimeError("on_event broke")

    def run(self, step: dict[str, Any]) -> Any:
        op = step["op"]
        return getattr(self, f"op_{op}")(**{k: v for k, v in step.items() if k != "op"})

    # source operations
    def op_collect(self, now: float = 0.0) -> dict[str, Any]:
        result = self.source.collect(now)
        return {"health": asdict(result.health), "gpus": [asdict(g) for g in result.gpus]}

    def op_wait_events(self, count: int, timeout: float = 60.0) -> dict[str, Any]:
        """Wait (generously) until ``count`` XID events came through take_events; on_event must wake us."""
        deadline = time.monotonic() + timeout
        woken = False
        while len(self.events) < count and time.monotonic() < deadline:
            if self.woken.wait(0.5):
                woken = True
                self.woken.clear()
            self.events.extend(self.source.take_events())
        got, self.events = self.events, []
        return {"woken": woken, "events": [asdict(e) for e in got]}

    def op_wait_errors(self, kind: str, count: int, timeout: float = 60.0) -> dict[str, int]:
        """Wait (generously) until the source has counted ``count`` errors of ``kind``: look again
        when the event thread wakes us, or every 50 ms. The wake is cleared each time, or, once
        set, it would make this a busy loop holding the GIL against the event thread it waits
        for (a flood of 10,000 events then took up to 30 s instead of 2 s)."""
        deadline = time.monotonic() + timeout
        while self.source.tally.snapshot().get(kind, 0) < count and time.monotonic() < deadline:
            if self.woken.wait(0.05):
                self.woken.clear()
        return self.source.tally.snapshot()

    def op_append_events(self, gpu: int, xids: list[int]) -> None:
        """Append many XID events in one write (a flood), numbered after the existing ones."""
        data = self.stub_nvml.load_scenario(self.scenario)
        events = data.setdefault("events", [])
        first = max((e["id"] for e in events), default=0) + 1
        events.extend({"id": first + n, "gpu": gpu, "data": xid} for n, xid in enumerate(xids))
        self.stub_nvml.write_scenario(self.scenario, data)

    def op_take_events(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.source.take_events()]

    def op_wait_event_sets(self, count: int, timeout: float = 60.0) -> bool:
        thread = self.source.event_thread
        return bool(thread and thread.wait_built(count, timeout))

    def op_close(self) -> dict[str, Any]:
        thread = self.source.event_thread
        self.source.close()
        return {"thread_alive": bool(thread and thread.alive)}

    def op_deny_handle(self, gpu: int) -> None:
        """Make ``nvmlDeviceGetHandleByIndex(gpu)`` answer NO_PERMISSION (a fault injected in this
        process: the stub library has no switch for it, and a real driver answers it for a GPU the
        container's device cgroup does not allow)."""
        import pynvml

        real = pynvml.nvmlDeviceGetHandleByIndex

        def denied(index):
            if int(index) == gpu:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
            return real(index)

        pynvml.nvmlDeviceGetHandleByIndex = denied

    def op_remove_gpu_during_walk(self, gpu: int, at_index: int) -> str:
        """Remove GPU ``gpu`` from the scenario the moment the source asks for the handle of
        ``at_index``, once: a GPU leaving in the middle of one walk, which the stub cannot time."""
        import pynvml

        real = pynvml.nvmlDeviceGetHandleByIndex
        removed: list[str] = []

        def tearing(index):
            if int(index) == at_index and not removed:
                removed.append(gpu)
                self.stub_nvml.remove_gpu(self.scenario, gpu)
            return real(index)

        pynvml.nvmlDeviceGetHandleByIndex = tearing
        return self.stub_nvml.load_scenario(self.scenario)["gpus"][gpu]["uuid"]

    # scenario mutations (the public helpers)
    def op_inject_xid(self, gpu: int, xid: int, **kwargs: Any) -> int:
        return self.stub_nvml.inject_xid(self.scenario, gpu, xid, **kwargs)

    def op_set_lost(self, gpu: int, lost: bool = True) -> None:
        self.stub_nvml.set_gpu_lost(self.scenario, gpu, lost)

    def op_remove_gpu(self, gpu: int) -> str:
        return self.stub_nvml.remove_gpu(self.scenario, gpu)["uuid"]

    def op_set_field(self, gpu: int, field: str, value: Any) -> None:
        self.stub_nvml.set_gpu_field(self.scenario, gpu, field, value)

    def op_write_text(self, text: str, encoding: str = "utf-8") -> None:
        """``encoding="latin-1"`` writes each character as one byte (to hand the stub invalid UTF-8)."""
        self.stub_nvml.write_scenario_text(self.scenario, text.encode(encoding))

    def op_write_scenario(self, data: dict[str, Any]) -> None:
        self.stub_nvml.write_scenario(self.scenario, data)

    # direct looks at the stub
    def op_preload_again(self, lib: str) -> bool:
        """Preloading a second copy (another cache folder) keeps the stub pynvml already holds."""
        return self.stub_nvml.preload_stub(Path(lib))._handle == self.lib._handle

    def op_soname_is_stub(self) -> bool:
        from healthagent.demo.stub_nvml import SONAME

        return ctypes.CDLL(SONAME)._handle == self.lib._handle

    def op_stub_stats(self) -> dict[str, Any]:
        loads, rejects = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        error = ctypes.create_string_buffer(512)
        self.lib.stubNvmlStats(ctypes.byref(loads), ctypes.byref(rejects), error, ctypes.c_uint(512))
        return {"loads": loads.value, "rejects": rejects.value, "last_error": error.value.decode("utf-8", "replace")}

    def op_pynvml(self, calls: list[list[Any]]) -> list[Any]:
        """Call pynvml functions directly: [name, *args]; a handle argument is written "@<index>"."""
        import pynvml

        out = []
        for name, *args in calls:
            args = [pynvml.nvmlDeviceGetHandleByIndex(int(a[1:])) if isinstance(a, str) and a.startswith("@")
                    else a for a in args]
            try:
                value = getattr(pynvml, name)(*args)
                if hasattr(value, "_fields_"):
                    value = {f[0]: _plain(getattr(value, f[0])) for f in value._fields_}
                out.append({"ok": _plain(value)})
            except pynvml.NVMLError as exc:
                out.append({"error": exc.value})
        return out

    def op_fuzz(self, seed: int, prefixes: bool, mutations: int) -> dict[str, Any]:
        """Feed every prefix and seeded mutations of the scenario to the stub; count the verdicts."""
        import pynvml

        base = self.scenario.read_bytes()
        blobs = [base[:n] for n in range(len(base))] if prefixes else []
        rng = random.Random(seed)
        alphabet = b'{}[]",:0123456789-+.eEtrufalsn\\ \n\x00\xff'
        for _ in range(mutations):
            blob = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(blob))
                action = rng.randrange(3)
                if action == 0:
                    blob[at] = rng.choice(alphabet)
                elif action == 1:
                    del blob[at]
                else:
                    blob.insert(at, rng.choice(alphabet))
            blobs.append(bytes(blob))
        before = self.op_stub_stats()
        unaccounted = 0
        for i, blob in enumerate(blobs):
            _rewrite_in_place(self.scenario, blob)
            stamp = 1_000_000_000_000_000_000 + i * 1000
            os.utime(self.scenario, ns=(stamp, stamp))  # a distinct mtime per write, no tick races
            count = pynvml.nvmlDeviceGetCount()  # exercises the reload path of a real entry point
            stats = self.op_stub_stats()
            seen = stats["loads"] + stats["rejects"] - before["loads"] - before["rejects"]
            if seen != i + 1 or count < 0:
                unaccounted += 1
        after = self.op_stub_stats()
        self.scenario.write_bytes(base)
        os.utime(self.scenario, ns=(2_000_000_000_000_000_000, 2_000_000_000_000_000_000))
        return {"fed": len(blobs), "unaccounted": unaccounted,
                "loads": after["loads"] - before["loads"], "rejects": after["rejects"] - before["rejects"],
                "count_after_restore": pynvml.nvmlDeviceGetCount()}

    def op_racing_rewrites(self, writes: int) -> dict[str, Any]:
        """Replace the scenario ``writes`` times with distinct malformed files while a thread makes
        the stub look at the file in a tight loop (as NVML's event thread does on every inotify wake
        during a write); after each write the main thread looks once more, so every write is seen.
        Returns how many rejections the stub counted for them: one per write when it tells writes
        apart exactly."""
        before = self.op_stub_stats()
        stop = threading.Event()

        def look() -> None:
            while not stop.is_set():
                self.op_stub_stats()

        thread = threading.Thread(target=look)
        thread.start()
        try:
            for n in range(writes):
                self.stub_nvml.write_scenario_text(self.scenario, '{"gpus": [' + " " * (n % 7))
                self.op_stub_stats()
        finally:
            stop.set()
            thread.join(60)
        after = self.op_stub_stats()
        return {"rejects": after["rejects"] - before["rejects"], "loads": after["loads"] - before["loads"]}

    def op_concurrent_reads(self, gpu: int, values: list[int], writes: int, readers: int) -> dict[str, Any]:
        """Readers call nvmlDeviceGetTemperature while the main thread rewrites the scenario."""
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        seen: set[int] = set()
        errors: list[str] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                try:
                    seen.add(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
                except Exception as exc:  # any failure is the finding
                    errors.append(repr(exc))

        threads = [threading.Thread(target=read) for _ in range(readers)]
        for t in threads:
            t.start()
        for i in range(writes):
            self.stub_nvml.set_gpu_field(self.scenario, gpu, "temperature_c", values[i % len(values)])
        stop.set()
        for t in threads:
            t.join(60)
        return {"seen": sorted(seen), "errors": errors[:5]}


def _rewrite_in_place(path: Path, blob: bytes) -> None:
    """Write ``blob`` over the file, then cut it to its length: the bytes of a truncating write,
    without handing the file's blocks back to the filesystem and taking them again each time (an
    O_TRUNC open of a file with data costs a few hundred microseconds, thousands of times here)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if os.pwrite(fd, blob, 0) != len(blob):
            raise OSError(f"short write to {path}")
        os.ftruncate(fd, len(blob))
    finally:
        os.close(fd)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as fh:
        plan = json.load(fh)
    driver = _Driver(plan["lib"], plan["scenario"], plan["source_args"])
    results = [driver.run(step) for step in plan["steps"]]
    if driver._source is not None:
        driver._source.close()
    sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
