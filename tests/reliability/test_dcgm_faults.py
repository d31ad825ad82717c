"""dcgm-exporter stops answering in time: a server that accepts and never replies, and one that
trickles its reply a byte at a time. Both are real TCP servers on 127.0.0.1.

The dcgm source blocks the loop for at most its timeout (2 s by default) per scrape, so the kernel
log keeps being read between scrapes and a fault there is acted on; each cut scrape is counted.
Before the fix in ``DcgmFetcher.fetch`` (read one socket receive at a time, deadline checked in
between), a trickling server held the loop for as long as it kept sending.
"""

from __future__ import annotations

import socket
import threading

import pytest

from bench.bench_training_client import NeverAnswers
from tests.reliability.helpers import alive, events_by_reason, our_taints, wait_metric, wait_warm
from tests.support.live_agent import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


class Trickler:
    """Answers 200 with a 1 MB Content-Length, then sends one byte every 0.2 s, forever."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10)
                conn.recv(65536)
                self.requests += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                             b"Content-Length: 1000000\r\n\r\n# HELP")
                while not self._stop.wait(0.2):
                    conn.sendall(b"#")
            except OSError:
                pass  # the agent gave up on this scrape: that is the point

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@pytest.fixture(params=["never-answers", "trickles"])
def stuck_exporter(request):
    server = NeverAnswers() if request.param == "never-answers" else Trickler()
    yield f"http://127.0.0.1:{server.port}/metrics"
    server.close()


def test_dcgm_exporter_that_does_not_answer_in_time(stuck_exporter, demo, fake, start_agent):
    runtime = start_agent(dcgm_url=stuck_exporter, dcgm_interval_seconds=0.1, dcgm_timeout_seconds=0.5)
    wait_warm(runtime)
    stuck = wait_metric(runtime, lambda s: (s.value("healthagent_source_errors_total", source="dcgm",
                                                    kind="timeout") or 0) >= 2, "two scrapes cut by the timeout")
    assert stuck.value("healthagent_source_up", source="dcgm") == 0
    demo.inject_xid(3, 95)  # between the stuck scrapes the kernel log is still read
    wait_metric(runtime, lambda s: s.value("healthagent_xid_errors_total", gpu="", uuid="", xid="95") == 1
                and (s.value("healthagent_source_errors_total", source="dcgm", kind="timeout") or 0) >= 4,
                "the XID, with dcgm still stuck")
    wait_until(lambda: our_taints(fake) == [("replace_node", "NoSchedule")], what="the taint")
    wait_until(lambda: events_by_reason(fake) == {"GPU_XID": 1}, what="one Event")
    assert alive(runtime)
