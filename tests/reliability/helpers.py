"""Helpers of the reliability tests: scrape an in-process agent, wait for it, check it lives."""

from __future__ import annotations

from tests.support.live_agent import Scrape, owned_taints, wait_until

NODE = "gpu-node-0"
TAINT_KEY = "healthagent.io/unhealthy"


def scrape(runtime) -> Scrape:
    return Scrape.of(runtime.server.port)


def wait_warm(runtime) -> None:
    """Until the agent cycled, its effects reached the API server once (first reconcile) and
    /metrics serves what that reconcile reported.

    Nothing here waits for the loop's idle cycle: a changed status rings the loop, which publishes
    it at once, and a status that did not change is in the snapshot already."""
    agent = runtime.agent
    worker = agent.effects_worker

    def warm() -> bool:
        snapshot = runtime.telemetry.snapshot
        return (agent.cycles >= 1 and worker.reconciles >= 1 and snapshot is not None
                and snapshot.kube == worker.status)

    wait_until(warm, what="the agent's first reconcile in its metrics")


def wait_metric(runtime, predicate, what: str, timeout: float = 90.0) -> Scrape:
    def check():
        got = scrape(runtime)
        return got if predicate(got) else None

    return wait_until(check, timeout, what, interval=0.05)


def alive(runtime) -> bool:
    """The loop thread and the effects thread both still run (nothing crashed them)."""
    worker = runtime.agent.effects_worker
    return runtime._thread.is_alive() and (worker is None or worker._thread.is_alive())


def our_taints(fake) -> list[tuple[str, str]]:
    """(value, effect) of the agent's taints on its node, in order."""
    return [(t.get("value"), t.get("effect")) for t in owned_taints(fake.node(NODE), TAINT_KEY)]


def events_by_reason(fake) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in fake.events():
        counts[event["reason"]] = counts.get(event["reason"], 0) + 1
    return counts


REPLACE = [("replace_node", "NoSchedule")]  # our_taints() while a replace_node verdict holds


def gpu_xid_events(fake) -> list[dict]:
    return [e for e in fake.events() if e["reason"] == "GPU_XID"]
