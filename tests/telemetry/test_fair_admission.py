"""Fair admission on a full listener: an address holding fewer slots takes the oldest slot of the
address holding the most, so no number of slow clients from other addresses keeps out the
kubelet's probe or Prometheus' scrape (``healthagent/telemetry/http_listener.py``).

The rule itself as a pure function, then real listeners on loopback, each client bound to an
address of its own (Linux routes all of 127/8 to lo): 127.0.0.2 .. 127.0.0.9 are eight pods,
127.0.0.10 the prober.
"""

from __future__ import annotations

import socket

import pytest

from bench.bench_serving import (
    FAIR_CLIENTS_PER_POD,
    POD_ADDRESSES,
    PROBE_ADDRESS,
    get_from,
    pod_flood,
)
from healthagent.telemetry.http_listener import Admission, Limits, admit
from healthagent.telemetry.server import AGENT_LIMITS
from tests.support.wait import wait_for
from tests.telemetry.harness import start_agent
from tests.telemetry.snapshots import demo_snapshot

LIMITS = Limits(max_connections=6, max_per_client=4)


# -- the rule --------------------------------------------------------------------------------------

def test_room_left_admits_anyone_under_its_own_cap():
    assert admit({"a": 3}, {"a": 1.0}, "a", LIMITS) == Admission()
    assert admit({"a": 4}, {"a": 1.0}, "a", LIMITS) == Admission(refused="refused_per_client")
    assert admit({"a": 4}, {"a": 1.0}, "b", LIMITS) == Admission()


def test_full_an_address_holding_fewer_evicts_from_the_address_holding_the_most():
    held, oldest = {"a": 2, "b": 3, "c": 1}, {"a": 1.0, "b": 5.0, "c": 0.5}
    assert admit(held, oldest, "new", LIMITS) == Admission(evict="b")
    assert admit(held, oldest, "c", LIMITS) == Admission(evict="b")
    assert admit(held, oldest, "a", LIMITS) == Admission(evict="b")


def test_full_ties_go_to_the_address_whose_oldest_connection_is_oldest():
    assert admit({"a": 3, "b": 3}, {"a": 9.0, "b": 2.0}, "new", LIMITS) == Admission(evict="b")
    assert admit({"a": 3, "b": 3}, {"a": 1.0, "b": 2.0}, "new", LIMITS) == Admission(evict="a")


def test_full_an_address_holding_as_many_as_any_other_is_refused():
    assert admit({"a": 3, "b": 3}, {"a": 1.0, "b": 2.0}, "a", LIMITS) == Admission(refused="refused")
    assert admit({"a": 2, "b": 2, "c": 2}, {"a": 1.0, "b": 2.0, "c": 3.0}, "b", LIMITS) == Admission(refused="refused")


def test_evicted_connections_still_closing_bound_the_threads():
    held, oldest = {"a": 6}, {"a": 1.0}
    assert admit(held, oldest, "new", LIMITS, closing=5) == Admission(evict="a")
    assert admit(held, oldest, "new", LIMITS, closing=6) == Admission(refused="refused")


@pytest.mark.parametrize("held", [
    {"p1": 8, "p2": 8, "p3": 8, "p4": 8},  # four pods at their cap: the case that starved probes
    {f"p{n}": 4 for n in range(8)},
    {f"p{n}": 1 for n in range(32)},
    {"node": 3, **{f"p{n}": 1 for n in range(29)}},
])
def test_an_address_holding_no_slot_always_gets_in(held):
    oldest = {address: float(n) for n, address in enumerate(held)}
    decision = admit(held, oldest, "kubelet", AGENT_LIMITS)
    assert decision.refused == "" and decision.evict == max(held, key=lambda a: (held[a], -oldest[a]))


# -- real listeners --------------------------------------------------------------------------------

def connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_probe_from_a_new_address_closes_the_oldest_idle_connection_of_the_fullest():
    agent = start_agent(agent_limits=Limits(max_connections=4, max_per_client=4, deadline_seconds=60.0))
    idle = [connect_from("127.0.0.2", agent.server.port) for _ in range(4)]
    try:
        wait_for(lambda: agent.server.held()["agent"] == {"127.0.0.2": 4}, what="four idle connections held")
        _, ok = get_from(PROBE_ADDRESS, agent.server.port, "/healthz", AGENT_LIMITS.deadline_seconds)
        assert ok
        assert closed_by_server(idle[0])  # the oldest made room
        wait_for(lambda: agent.server.held()["agent"] == {"127.0.0.2": 3}, what="the probe's slot released")
        for conn in idle[1:]:
            conn.settimeout(0.05)
            with pytest.raises(socket.timeout):  # still open: nothing more was taken from the pod
                conn.recv(1)
        assert agent.server.errors.get("evicted") == 1
        # The pod may have its slot back while there is room, but never more than an equal share.
        idle.append(connect_from("127.0.0.2", agent.server.port))
        wait_for(lambda: agent.server.held()["agent"] == {"127.0.0.2": 4}, what="the pod's fourth slot again")
        extra = connect_from("127.0.0.2", agent.server.port)
        idle.append(extra)
        assert closed_by_server(extra)  # it holds every slot: refused, nobody evicted
        assert agent.server.errors.get("refused_per_client") == 1 and agent.server.errors.get("evicted") == 1
    finally:
        for conn in idle:
            conn.close()
        agent.server.stop()


@pytest.mark.integration
def test_eight_pods_of_slow_clients_cannot_starve_probes_and_scrapes():
    """8 addresses x 25 slow clients on the agent's port (32 slots, 8 per address) and 100 on the
    intake: every probe and scrape from another address is answered within the listener's own
    deadline. Before fair admission, 4 such pods took every slot and none was answered."""
    agent = start_agent()
    agent.telemetry.publish(demo_snapshot())
    flood = pod_flood(agent.server.port, agent.server.intake_port)
    try:
        def every_slot_held_by_the_pods() -> bool:
            held = agent.server.held()
            return (sum(held["agent"].values()) == AGENT_LIMITS.max_connections
                    and set(held["agent"]) == set(POD_ADDRESSES)
                    and sum(held["intake"].values()) > 0)

        wait_for(every_slot_held_by_the_pods, what=f"{len(POD_ADDRESSES)} pods x {FAIR_CLIENTS_PER_POD} slow "
                                                   f"clients to take every slot of the agent's port")
        for _ in range(20):
            for path in ("/healthz", "/metrics"):
                _, ok = get_from(PROBE_ADDRESS, agent.server.port, path, AGENT_LIMITS.deadline_seconds)
                assert ok, f"{path} from {PROBE_ADDRESS} was not answered 200"
        assert all(count <= AGENT_LIMITS.max_per_client for count in agent.server.held()["agent"].values())
    finally:
        for clients in flood:
            clients.stop()
        agent.server.stop()
