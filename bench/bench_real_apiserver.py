"""On a real API server: XID line to taint, and the operator's clear under a second writer's churn.

    .venv/bin/python -m bench.bench_real_apiserver [--runs 20] [--churn-runs 20] [--churn-rate 100]
                                                   [--churn-writers 2]

Needs a real ``kube-apiserver`` and ``etcd`` (``KUBEBUILDER_ASSETS``, the envtest convention; see
``tests/support/envtest.py``). One control plane (etcd + kube-apiserver on loopback, RBAC on) serves
the whole bench. Each part seeds 10 GPU Node objects carrying a label of its own and points the
agent's ``budget_node_selector`` at it (10 % of 10 nodes: the budget allows the one taint).

The agent is the whole thing, ``python -m healthagent run`` as a subprocess (the DaemonSet's
command), on the demo node's host root (``healthagent/demo/node.py``) with NVML off, reading the
demo node's kernel-log file (``--kernel-log``), writing through the real ``kubernetes`` client with
the control plane's admin certificate (a kubeconfig; the agent's own RBAC is tested in
``tests/deploy``). The bench follows the node with a watch of its own (its own TLS connection,
every event stamped as it arrives), so no measurement waits on a poll interval.

1. XID line -> taint: once the agent is warm (first reconcile written, its node watch up), wait a
   random 0-100 ms (the injection lands anywhere between the agent's reads), append the
   driver's XID 94 record to the kernel log (``DemoNode.inject_xid``), and stop the clock when the
   bench's watch delivers the node carrying the agent's taint. Then clear: annotate the node
   ``healthagent.io/clear=<a new token>``, wait until the taint is gone and the agent has applied
   the clear to its findings, and go again (a new XID after a clear is a new finding).
2. The clear under churn: other writers PATCH the node's labels ``--churn-rate`` times a second in
   all (``tests/support/clusters.py``'s ``LabelChurn``, a strategic-merge PATCH with a new value
   each time; ``--churn-writers`` threads share the rate) for the whole part, while the agent is tainted
   (XID line -> taint, as above) and cleared: the clock for the clear starts when the bench's watch
   delivers the node carrying the new annotation and stops when it delivers the node without the
   taint (both stamps from the same watch; the PATCH's own round trip is printed apart).
   The agent's ``healthagent_kube_writes_total`` and ``healthagent_kube_api_errors_total`` are
   scraped before and after, to count conflicts.

Every wait is bounded; all traffic is on loopback.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.common import machine, percentile, table
from healthagent.effects.node_desired import CLEAR_ANNOTATION, CLEAR_HANDLED_ANNOTATION
from tests.support.clusters import LabelChurn, RealCluster
from tests.support.envtest import ControlPlane, find_assets, missing_reason
from tests.support.live_agent import AgentProcess, Scrape, wait_until

TAINT_KEY = "healthagent.io/unhealthy"
XID = 94
GPU = 3
SEED_NODES = 10  # 10 % of 10: the budget allows one taint
# the agent's "xids=94 verdict=..." line (``healthagent run`` logs "%(asctime)s %(levelname)s %(name)s ...")
XID_LOG_LINE = re.compile(rf"^(\d{{4}}-\d\d-\d\d) (\d\d:\d\d:\d\d),(\d{{3}}) INFO \S+ xids={XID} ", re.MULTILINE)
STEP_TIMEOUT = 60.0  # the longest any single wait may take (a bound, never a measurement)
PROBE_ANNOTATION = "bench.healthagent.io/probe"  # the bench's own write, to prove its watch is live
WATCH_SECONDS = 1800  # server-side timeoutSeconds of the bench's watch; re-opened if it ends early


# -- the bench's own watch on the node ----------------------------------------------------------------

@dataclass(frozen=True)
class Seen:
    """One watch event on the node, stamped (``time.monotonic()``) when its line arrived."""

    at: float
    version: str
    taint: tuple[str, ...]  # "value:effect" of the agent's taints
    clear: str
    handled: str
    probe: str


class NodeFollower:
    """A watch on one Node (``fieldSelector=metadata.name=...``) with the admin certificate, on a
    thread; keeps a short summary of every event so a 100-writes/s churn costs little memory."""

    def __init__(self, plane: ControlPlane, name: str) -> None:
        self._plane = plane
        self._name = name
        self._session = plane.admin_session()
        self._cond = threading.Condition()
        self._seen: list[Seen] = []
        self._stop = threading.Event()
        self._reply = None
        self.reopened = 0
        self.errors: list[str] = []
        reply = self._session.get(f"{plane.url}/api/v1/nodes", timeout=10,
                                  params={"fieldSelector": f"metadata.name={name}"})
        reply.raise_for_status()
        self._version = reply.json()["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, name=f"follow-{name}", daemon=True)
        self._thread.start()

    def __enter__(self) -> "NodeFollower":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._cut()
        self._thread.join(10)

    def _cut(self) -> None:
        """End the open watch stream now: shut its socket down (closing the reply from this thread
        would wait for the reading thread's next event)."""
        reply = self._reply
        connection = getattr(getattr(reply, "raw", None), "_connection", None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def mark(self) -> int:
        with self._cond:
            return len(self._seen)

    def count(self) -> int:
        return self.mark()

    def prove_live(self, core, tries: int = 5) -> None:
        """Write an annotation of the bench's own and see it arrive on the watch; a watch that
        does not deliver it within 5 s is opened again (from its last version)."""
        for attempt in range(tries):
            value = f"{time.time():.6f}"
            since = self.mark()
            core.patch_node(self._name, {"metadata": {"annotations": {PROBE_ANNOTATION: value}}})
            try:
                self.wait(lambda s: s.probe == value, since, "the bench's probe", timeout=5.0)
                return
            except TimeoutError:
                self._cut()  # _run opens the watch again, from its last version
        raise TimeoutError(f"the bench's watch on {self._name} delivers nothing (errors: {self.errors[-3:]})")

    def wait(self, predicate: Callable[[Seen], bool], since: int, what: str,
             timeout: float = STEP_TIMEOUT) -> Seen:
        """The first event from index ``since`` on that ``predicate`` accepts."""
        deadline = time.monotonic() + timeout
        with self._cond:
            index = since
            while True:
                while index < len(self._seen):
                    if predicate(self._seen[index]):
                        return self._seen[index]
                    index += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no watch event with {what} within {timeout:.0f} s "
                                       f"(watch errors: {self.errors[-3:]})")
                self._cond.wait(left)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - started < 2 * WATCH_SECONDS:
            try:
                self._follow()
            except Exception as exc:  # noqa: BLE001 - recorded; a stopped follower closes its reply
                if self._stop.is_set():
                    return
                self.errors.append(repr(exc))
                if len(self.errors) > 20:
                    return
                self._stop.wait(0.2)
            self.reopened += 1

    def _follow(self) -> None:
        params = {"watch": "true", "fieldSelector": f"metadata.name={self._name}",
                  "resourceVersion": self._version, "timeoutSeconds": str(WATCH_SECONDS),
                  "allowWatchBookmarks": "true"}
        reply = self._session.get(f"{self._plane.url}/api/v1/nodes", params=params, stream=True,
                                  timeout=(10, 120))
        self._reply = reply
        try:
            reply.raise_for_status()
            for line in reply.iter_lines(chunk_size=None):
                at = time.monotonic()
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                meta = obj.get("metadata") or {}
                if event.get("type") == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                self._version = meta.get("resourceVersion") or self._version
                if event.get("type") == "BOOKMARK":
                    continue
                annotations = meta.get("annotations") or {}
                taints = tuple(f"{t.get('value')}:{t.get('effect')}"
                               for t in (obj.get("spec") or {}).get("taints") or [] if t.get("key") == TAINT_KEY)
                seen = Seen(at=at, version=self._version, taint=taints,
                            clear=annotations.get(CLEAR_ANNOTATION, ""),
                            handled=annotations.get(CLEAR_HANDLED_ANNOTATION, ""),
                            probe=annotations.get(PROBE_ANNOTATION, ""))
                with self._cond:
                    self._seen.append(seen)
                    self._cond.notify_all()
                if self._stop.is_set():
                    return
        finally:
            reply.close()


# -- the agent on one node -------------------------------------------------------------------------

class Bed:
    """Ten GPU nodes of one part, the demo host root, the agent on node 0 and the bench's watch."""

    def __init__(self, plane: ControlPlane, part: str, work: Path) -> None:
        from healthagent.demo.node import build_demo_root

        self.cluster = RealCluster(plane, f"bench-{part}-{int(time.time())}-")
        self.cluster.seed(SEED_NODES)
        self.name = self.cluster.name(0)
        self.demo = build_demo_root(work / part / "root")
        from kubernetes import client

        self.core = client.CoreV1Api(plane.api_client())
        self.follower = NodeFollower(plane, self.name)
        self.agent = AgentProcess(
            dict(host_root=str(self.demo.root), kernel_log=str(self.demo.kernel_log), no_nvml=True,
                 kube="kubeconfig", kubeconfig=str(plane.write_kubeconfig(work / part / "kubeconfig")),
                 node_name=self.name, state_file=str(work / part / "state.json"), listen="127.0.0.1:0",
                 log_level="INFO"),
            work / part / "agent.log",
            env={"HEALTHAGENT_BUDGET_NODE_SELECTOR": self.cluster.budget_selector,
                 # the budget's Leases in the namespace the cluster made for them (outside a pod the
                 # agent would use "healthagent", which this control plane does not have: 404s)
                 "HEALTHAGENT_BUDGET_NAMESPACE": self.cluster.budget_namespace})
        self.tokens = 0
        self.xids = 0
        try:
            # warm: the first reconcile has written the labels and conditions, the node watch is up
            self.agent.wait_metric(
                lambda s: (s.value("healthagent_kube_watch_up") == 1.0
                           and s.value("healthagent_kube_pending_writes") == 0.0
                           and s.total("healthagent_kube_writes_total", kind="node_status", result="ok") >= 1),
                timeout=120, what="a warm agent")
            self.follower.prove_live(self.core)
        except BaseException as exc:
            log_tail = self.agent.log()[-3000:]
            self.close()
            raise RuntimeError(f"the agent on {self.name} did not get warm: {exc!r}\n{log_tail}") from exc

    def close(self) -> None:
        self.follower.stop()
        self.agent.close()
        self.cluster.close()

    def taint(self) -> tuple[float, float]:
        """(seconds from the XID record in the kernel log to the watch showing the agent's taint,
        seconds from the record to the agent's log line that reports the XID: detection)."""
        time.sleep(random.uniform(0.0, 0.1))  # a random phase against the 0.1 s kernel-log poll
        since = self.follower.mark()
        self.demo.inject_xid(GPU, XID, via="kmsg")
        written, written_wall = time.monotonic(), time.time()
        seen = self.follower.wait(lambda s: bool(s.taint), since, "the agent's taint")
        self.xids += 1
        # the agent logs "xids=94 verdict=..." (millisecond stamps) before it hands the verdict over

        def logged_lines():
            found = XID_LOG_LINE.findall(self.agent.log())
            return found if len(found) >= self.xids else None

        day, clock, millis = wait_until(logged_lines, STEP_TIMEOUT, "the agent's XID log line")[self.xids - 1]
        logged = time.mktime(time.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        return seen.at - written, logged - written_wall

    def clear(self) -> tuple[float, float, float]:
        """Annotate the node ``healthagent.io/clear=<new token>``; returns (seconds from the watch
        delivering the annotation to the watch delivering the node without the taint, seconds from
        sending the PATCH to the taint gone, seconds the PATCH took). Then waits until the agent
        has applied the clear to its findings, so the next XID is a new finding."""
        self.tokens += 1
        token = f"bench-{self.tokens}-{random.randrange(1 << 30):x}"
        since = self.follower.mark()
        sent = time.monotonic()
        self.core.patch_node(self.name, {"metadata": {"annotations": {CLEAR_ANNOTATION: token}}})
        replied = time.monotonic()
        annotated = self.follower.wait(lambda s: s.clear == token, since, "the clear annotation")
        gone = self.follower.wait(lambda s: not s.taint and s.handled == token, since, "the taint gone")
        self.agent.wait_log(rf"operator_clear token={re.escape(token)} findings_cleared",
                            timeout=STEP_TIMEOUT)
        return gone.at - annotated.at, gone.at - sent, replied - sent

    def counters(self) -> dict[str, float]:
        scrape: Scrape = self.agent.scrape()
        out: dict[str, float] = {}
        for sample in scrape.samples:
            if sample.name == "healthagent_kube_writes_total":
                out[f"writes {sample.labels['kind']} {sample.labels['result']}"] = sample.value
            elif sample.name == "healthagent_kube_api_errors_total":
                out[f"api_errors {sample.labels['kind']}"] = sample.value
            elif (sample.name == "healthagent_internal_errors_total"
                  and sample.labels.get("component") == "kube"):
                out[f"internal kube {sample.labels['kind']}"] = sample.value
        return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(before) | set(after))}


def summary(label: str, values: list[float]) -> list[str]:
    def ms(x: float) -> str:
        return f"{x * 1000:.0f}"

    return [label, str(len(values)), ms(percentile(values, 0.5)), ms(percentile(values, 0.9)),
            ms(percentile(values, 0.99)), ms(min(values)), ms(max(values))]


TAINT_ROW = "XID line written -> taint on the watch"
DETECT_ROW = "  of which XID line -> agent logs the XID"
REST_ROW = "  of which that log line -> taint on the watch"
CLEAR_ROW = "clear: annotation on the watch -> taint gone"
SENT_ROW = "clear: annotation PATCH sent -> taint gone"
HEADER = ["measure", "runs", "p50 ms", "p90 ms", "p99 ms", "min ms", "max ms"]


OFFSET = 10_000_000  # between the label values of two churn writers
SETTLE_SECONDS = 1.0  # after the last clear: its condition write and Event land before the last scrape


@dataclass
class Cycles:
    """The figures of ``runs`` taint-and-clear cycles on one bed, in milliseconds."""

    taints: list[float] = field(default_factory=list)  # XID line -> taint on the watch
    detects: list[float] = field(default_factory=list)  # XID line -> the agent's log line reporting it
    clears: list[float] = field(default_factory=list)  # annotation on the watch -> taint gone
    from_sent: list[float] = field(default_factory=list)  # annotation PATCH sent -> taint gone
    patches: list[float] = field(default_factory=list)  # the annotation PATCH's round trip


def run_cycles(bed: "Bed", runs: int) -> Cycles:
    """Taint (an XID line) and clear (the annotation) ``runs`` times, then let the agent settle."""
    cycles = Cycles()
    for _ in range(runs):
        taint, detect = bed.taint()
        cycles.taints.append(taint)
        cycles.detects.append(detect)
        clear, total, patch = bed.clear()
        cycles.clears.append(clear)
        cycles.from_sent.append(total)
        cycles.patches.append(patch)
    time.sleep(SETTLE_SECONDS)
    return cycles


def part_one(plane: ControlPlane, work: Path, runs: int) -> tuple[list[float], list[float], list[float],
                                                                list[float], dict[str, int]]:
    bed = Bed(plane, "xid", work)
    try:
        before = bed.counters()
        cycles = run_cycles(bed, runs)
        return cycles.taints, cycles.detects, cycles.clears, cycles.from_sent, delta(before, bed.counters())
    finally:
        bed.close()


@dataclass
class ChurnResult:
    taints: list[float]
    detects: list[float]  # XID line -> the agent's log line reporting it
    clears: list[float]  # annotation on the watch -> taint gone on the watch
    from_sent: list[float]  # annotation PATCH sent -> taint gone on the watch
    patches: list[float]  # the annotation PATCH's round trip
    counts: dict[str, int]
    rate: float  # label writes/s achieved, all writers together
    failed: int  # label writes that failed
    events: float  # node events/s the bench's watch saw


def part_two(plane: ControlPlane, work: Path, runs: int, rate: float, writers: int) -> ChurnResult:
    bed = Bed(plane, "churn", work)
    churns: list[LabelChurn] = []
    try:
        bound = 60.0 + runs * 2 * STEP_TIMEOUT  # the churn stops by itself after this long
        for index in range(writers):
            churn = LabelChurn(bed.cluster, bed.name, rate=rate / writers, max_seconds=bound)
            # Each writer sets the label to its ``writes`` count; apart by a large offset, two
            # writers never write the same value (a PATCH to the value already there changes
            # nothing: no new version, no watch event, not churn).
            churn.writes = index * OFFSET
            churns.append(churn.__enter__())

        def written() -> int:
            return sum(c.writes - i * OFFSET for i, c in enumerate(churns))

        wait_until(lambda: written() >= 50, 30, "the churn to run")
        before = bed.counters()
        start_writes, start_events, start = written(), bed.follower.count(), time.monotonic()
        cycles = run_cycles(bed, runs)
        elapsed = time.monotonic() - start
        result = ChurnResult(cycles.taints, cycles.detects, cycles.clears, cycles.from_sent, cycles.patches,
                             delta(before, bed.counters()),
                             (written() - start_writes) / elapsed, sum(len(c.errors) for c in churns),
                             (bed.follower.count() - start_events) / elapsed)
        return result
    finally:
        for churn in churns:
            churn.stop()
        bed.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--churn-runs", type=int, default=20)
    parser.add_argument("--churn-rate", type=float, default=100.0, help="label writes/s, all writers together")
    parser.add_argument("--churn-writers", type=int, default=2,
                        help="threads sharing the rate, each with its own client (one alone cannot keep "
                             "100/s on a small machine: each PATCH waits for its reply)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    random.seed(1)
    assets = find_assets()
    if assets is None:
        raise SystemExit(missing_reason())
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp, ControlPlane(assets) as plane:
        version = plane.admin_session().get(f"{plane.url}/version", timeout=10).json().get("gitVersion", "?")
        print(f"real API server: kube-apiserver {version} + etcd on loopback; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}")

        taints, detects, clears, from_sent, counts = part_one(plane, Path(tmp), args.runs)
        print(f"\n1. XID {XID} line -> taint, then the operator's clear; no other writer, {args.runs} runs")
        print(table(HEADER, [summary(TAINT_ROW, taints), summary(DETECT_ROW, detects),
                             summary(REST_ROW, [t - d for t, d in zip(taints, detects)]),
                             summary(CLEAR_ROW, clears),
                             summary(SENT_ROW, from_sent)]))
        print("p99 is nearest-rank: with 100 runs or fewer it is the largest run (= max).")
        print("agent counters over the part (delta): "
              + (", ".join(f"{k}={v}" for k, v in counts.items() if v) or "-"))

        churn = part_two(plane, Path(tmp), args.churn_runs, args.churn_rate, args.churn_writers)
        print(f"\n2. the same while {args.churn_writers} other writers PATCH the node's labels "
              f"(asked {args.churn_rate:.0f}/s in all, achieved {churn.rate:.0f}/s, {churn.failed} failed; "
              f"the bench's watch saw {churn.events:.0f} node events/s), {args.churn_runs} runs")
        print(table(HEADER, [summary(TAINT_ROW, churn.taints), summary(DETECT_ROW, churn.detects),
                             summary(REST_ROW, [t - d for t, d in zip(churn.taints, churn.detects)]),
                             summary(CLEAR_ROW, churn.clears),
                             summary(SENT_ROW, churn.from_sent),
                             summary("the annotation PATCH's round trip", churn.patches)]))
        print("agent counters over the part (delta): "
              + (", ".join(f"{k}={v}" for k, v in churn.counts.items() if v) or "-"))
        conflicts = sum(v for k, v in churn.counts.items() if k.startswith("writes ") and k.endswith(" conflict"))
        api_errors = sum(v for k, v in churn.counts.items() if k.startswith("api_errors "))
        print(f"healthagent_kube_writes_total{{result=\"conflict\"}}: +{conflicts}; "
              f"healthagent_kube_api_errors_total (all kinds): +{api_errors}")


if __name__ == "__main__":
    main()
