"""EFA sysfs goes wrong under a running agent: garbage in counter files, files and whole devices
vanishing, a device that comes and goes while it is being read.

The demo node's sysfs tree is the real input (``EfaSource`` reads it through ``--host-root``); the
files are changed the way a driver reload or a broken driver changes them.
"""

from __future__ import annotations

import os
import random
import shutil
import threading

import pytest

from tests.reliability.helpers import alive, events_by_reason, our_taints, scrape, wait_metric, wait_warm
from tests.support.live_agent import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

FAST = dict(efa_interval_seconds=0.1)


def counter_file(demo, device: str, name: str, port: bool = True):
    base = demo.efa_device_dir(device)
    return base / "ports" / "1" / "hw_counters" / name if port else base / "hw_counters" / name


def replace_with(path, text: str) -> None:
    os.chmod(path, 0o644)
    path.write_text(text)


def test_garbage_and_vanished_counter_files(demo, fake, start_agent):
    runtime = start_agent(**FAST)
    wait_warm(runtime)
    d = demo.efa_devices
    before = scrape(runtime)
    assert before.total("healthagent_source_errors_total", source="efa") == 0
    kept_rx_bytes = before.value("healthagent_efa_rx_bytes_total", efa_device=d[0], port="1")

    replace_with(counter_file(demo, d[0], "rx_drops"), "garbage\n")
    replace_with(counter_file(demo, d[1], "rdma_read_wr_err"), "")
    replace_with(counter_file(demo, d[2], "retrans_pkts"), "18446744073709551616\n")  # 2**64: not a u64
    os.unlink(counter_file(demo, d[3], "cmds_err", port=False))
    os.mkdir(counter_file(demo, d[3], "cmds_err", port=False))  # a directory where a file was
    os.unlink(counter_file(demo, d[4], "rx_bytes"))
    os.mkfifo(counter_file(demo, d[4], "rx_bytes"))  # a FIFO: read without blocking, it says nothing
    os.unlink(counter_file(demo, d[5], "tx_bytes"))  # gone between two reads
    shutil.rmtree(demo.efa_device_dir(d[6]) / "ports" / "1" / "hw_counters")  # a whole directory gone

    bad = wait_metric(runtime, lambda s: s.value("healthagent_source_errors_total", source="efa", kind="parse")
                      and s.value("healthagent_source_errors_total", source="efa", kind="parse") >= 8
                      and s.value("healthagent_source_errors_total", source="efa", kind="unreadable"),
                      "the garbage counted")
    assert bad.value("healthagent_source_up", source="efa") == 1
    assert bad.value("healthagent_efa_devices") == 32  # every device still reported
    assert bad.value("healthagent_efa_rx_drops_total", efa_device=d[0], port="1") is None  # absent, never 0
    assert bad.value("healthagent_efa_rx_bytes_total", efa_device=d[0], port="1") == kept_rx_bytes
    assert bad.value("healthagent_efa_tx_bytes_total", efa_device=d[5], port="1") is None
    assert bad.value("healthagent_efa_rx_bytes_total", efa_device=d[6], port="1") is None
    assert bad.value("healthagent_efa_submitted_cmds_total", efa_device=d[6], port="1") is not None
    assert bad.value("healthagent_node_action", action="none") == 1  # garbage is not a fault
    assert bad.total("healthagent_source_errors_total", source="efa", kind="exception") == 0

    # A real fault on another device among all this is still found, reported once.
    demo.bump_efa_counter(d[9], "no_completion_cmds", 3)
    found = wait_metric(runtime, lambda s: s.value("healthagent_findings", code="EFA_ADMIN_QUEUE_STUCK",
                                                   action="reboot_node") == 1, "EFA_ADMIN_QUEUE_STUCK")
    assert found.value("healthagent_node_action", action="reboot_node") == 1
    wait_until(lambda: our_taints(fake) == [("reboot_node", "NoSchedule")], what="the taint")
    wait_until(lambda: events_by_reason(fake) == {"EFA_ADMIN_QUEUE_STUCK": 1}, what="one Event")
    assert alive(runtime)


def test_devices_vanish_and_come_back_while_being_read(demo, fake, start_agent):
    from healthagent.demo.node import LIFESPAN_MS, healthy_efa_counters, write_rdma_device

    runtime = start_agent(**FAST)
    wait_warm(runtime)
    gone = demo.efa_devices[7]
    demo.remove_efa_device(gone)
    missing = wait_metric(runtime, lambda s: s.value("healthagent_efa_devices") == 31
                          and s.value("healthagent_findings", code="EFA_DEVICE_MISSING", action="reboot_node") == 1,
                          "the missing device")
    assert missing.value("healthagent_efa_port_up", efa_device=gone, port="1") is None
    wait_until(lambda: our_taints(fake) == [("reboot_node", "NoSchedule")], what="the taint")

    # Another device flaps (driver reloads) while the agent reads every 0.1 s.
    flapping = demo.efa_devices[20]
    pci = demo.efa_device_dir(flapping).parent.parent.name
    device_counters, port_counters = healthy_efa_counters(20, 7200.0)
    stop = threading.Event()
    flaps = 0

    def flap() -> None:
        nonlocal flaps
        rng = random.Random(5)
        while not stop.is_set() and flaps < 60:
            demo.remove_efa_device(flapping)
            stop.wait(rng.uniform(0, 0.05))
            write_rdma_device(demo.root, flapping, pci,
                              device_counters={**device_counters, "lifespan": LIFESPAN_MS + "\n"},
                              port_counters={**port_counters, "lifespan": LIFESPAN_MS + "\n"})
            stop.wait(rng.uniform(0, 0.05))
            flaps += 1

    cycles = runtime.agent.cycles
    thread = threading.Thread(target=flap, daemon=True)
    thread.start()
    thread.join(120)
    stop.set()
    wait_until(lambda: runtime.agent.cycles > cycles + 30, what="cycles during and after the flapping")
    settled = wait_metric(runtime, lambda s: s.value("healthagent_efa_devices") == 31, "31 devices again")
    assert flaps == 60
    assert settled.value("healthagent_source_up", source="efa") == 1
    assert settled.total("healthagent_source_errors_total", source="efa", kind="exception") == 0
    assert settled.value("healthagent_efa_port_up", efa_device=flapping, port="1") == 1
    assert our_taints(fake) == [("reboot_node", "NoSchedule")]
    assert events_by_reason(fake) == {"EFA_DEVICE_MISSING": 1}
    assert alive(runtime)
