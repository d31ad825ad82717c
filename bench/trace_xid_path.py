"""How many steps an XID line takes to become a taint PATCH: counted with a profiler, not by hand.

    .venv/bin/python -m bench.trace_xid_path

The real agent (``AgentRuntime``, NVML off so the kernel log is the only XID reporter) runs on the
demo node against the fake API server. A profile hook on every thread records, for the package's
own functions only (``healthagent/``):

- on the loop thread, the call stack when the kernel-log parser builds the ``XidEvent``, when
  policy joins it to an incident and when the verdict is handed to the effects worker
  (``EffectsWorker.submit``);
- on the effects thread, the call stack when ``ApiBackend.patch_node`` sends the taint.

The path is the package functions on those stacks, in order, from the source that reads the line
(the loop above it, ``run`` -> ``cycle`` -> ``_collect``, is printed apart: it drives every source
and is not the XID's path); each next stack adds only the frames below the caller it shares with
the one before (walked once). A hop is one step along that path, the hand-off between the threads
(``submit`` -> the worker's ``_run``) included. Helpers
called and returned from between two steps (a formatter, a rule that found nothing) are not on
the path; the number of distinct package functions entered while the XID travels is printed
too, for the wider picture.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

from healthagent.config import load_settings
from tests.support.live_agent import HoldingKubeFake, taint_write, wait_until, write_kubeconfig

NODE = "gpu-node-0"
TAINT_KEY = "healthagent.io/unhealthy"
PACKAGE = str(Path(__file__).resolve().parent.parent / "healthagent")


def _frames(frame) -> list[str]:
    """The package's frames of a stack, outermost first, as 'module.py:function'."""
    names = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            names.append(f"{path[len(PACKAGE) + 1:]}:{frame.f_code.co_name}")
        frame = frame.f_back
    return names[::-1]


# Where the XID is, step by step: the parser builds the event, policy joins it to an incident,
# the verdict is handed to the effects worker, the backend sends the taint.
MARKERS = ("sources/kernel_log/parser.py:_xid_event", "policy/incidents.py:take",
           "effects/worker.py:submit", "effects/backend.py:patch_node")


class Tracer:
    def __init__(self) -> None:
        self.armed = False
        self.entered: set[str] = set()
        self.stacks: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call" or not self.armed:
            return
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return
        name = f"{path[len(PACKAGE) + 1:]}:{frame.f_code.co_name}"
        with self.lock:
            self.entered.add(name)
            if name in MARKERS and name not in self.stacks:
                self.stacks[name] = _frames(frame)


def main() -> None:
    from healthagent.demo.node import build_demo_root
    from healthagent.wiring import AgentRuntime

    tracer = Tracer()
    with tempfile.TemporaryDirectory() as tmp, HoldingKubeFake() as fake:
        work = Path(tmp)
        demo = build_demo_root(work / "root")
        fake.seed_nodes(20)
        settings = load_settings(env={}, flags=dict(
            host_root=str(demo.root), kube="kubeconfig", node_name=NODE, nvml=False,
            kernel_log=str(demo.kernel_log), kubeconfig=str(write_kubeconfig(fake.url, work / "kubeconfig")),
            state_file=str(work / "state.json"), listen="127.0.0.1:0", log_level="WARNING"))
        runtime = AgentRuntime(settings)
        threading.setprofile(tracer)
        sys.setprofile(tracer)
        runtime.start()
        try:
            wait_until(lambda: runtime.agent.effects_worker.reconciles >= 1, what="a warm agent")
            time.sleep(0.3)
            tracer.armed = True
            demo.inject_xid(3, 94, via="kmsg")
            stored = taint_write(TAINT_KEY)
            wait_until(lambda: any(r.status == 200 and stored(r.method, r.path, r.body)
                                   for r in fake.requests("PATCH")), what="the taint")
            tracer.armed = False
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            runtime.stop()
    stacks = [tracer.stacks.get(m, []) for m in MARKERS]
    missing = [m for m, st in zip(MARKERS, stacks) if not st]
    if missing:
        raise SystemExit(f"the XID never reached: {', '.join(missing)}")
    loop_path = _join(stacks[:3])
    effects = stacks[3]
    effects_path = effects[[i for i, f in enumerate(effects) if f.endswith(":_run")][-1]:]
    start = next(i for i, f in enumerate(loop_path) if f.startswith("sources/"))
    driver, path = loop_path[:start], loop_path[start:] + effects_path
    print("the loop that drives it: " + " -> ".join(driver))
    print("the XID's path, from the source that reads the line to the PATCH (package functions, in order):")
    for i, name in enumerate(path):
        print(f"  {i:2d} {name}")
    handoff = len(loop_path) - start
    print(f"hops: {len(path) - 1} (loop thread {handoff - 1}, hand-off to the effects thread 1, "
          f"effects thread {len(effects_path) - 1})")
    modules = sorted({name.split(':')[0] for name in path})
    print(f"modules on the path: {len(modules)}: {', '.join(modules)}")
    print(f"distinct package functions entered while the XID travelled: {len(tracer.entered)}")


def _join(stacks: list[list[str]]) -> list[str]:
    """One thread's path through successive stacks: each next stack adds the frames below what
    it shares with the previous one (the caller they share is walked once)."""
    path = list(stacks[0])
    for previous, stack in zip(stacks, stacks[1:]):
        common = 0
        while common < min(len(previous), len(stack)) and previous[common] == stack[common]:
            common += 1
        path += stack[common:]
    return path


if __name__ == "__main__":
    main()
