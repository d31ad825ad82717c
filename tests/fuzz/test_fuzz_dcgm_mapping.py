"""Fuzz the mapping of dcgm-exporter's text onto GPU samples, through a real HTTP server.

``tests/sources/test_dcgm.py`` already feeds random characters to the parser. This fuzzer makes
bodies that *parse* (valid exposition lines with the exporter's own metric and label names) but
carry what a broken or unusual exporter could: GPU indices that are not numbers, missing or
repeated UUIDs, NaN and infinities, negative counters, DCGM's blank sentinels, values beyond 2**64,
NVLink per-link series, MIG labels, last-XID gauges that change or not. ``DcgmSource.collect``
must return a result every time, with counters that are non-negative integers or None, finite
gauges, and an XID event only for a changed, non-zero last-XID gauge.
"""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthagent.sources.dcgm import FIELD_OF_METRIC, DcgmSource

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BLANKS = (9223372036854775794.0, 9223372036854775807.0, 140737488355328.0, 140737488355330.0)

values = st.one_of(st.integers(-10, 10**6).map(float), st.integers(0, 120).map(float),
                   st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from(BLANKS + (2.0 ** 64, 2.0 ** 70, -0.0, 1e-300)))
label_values = st.one_of(st.text(max_size=12), st.sampled_from(["0", "1", "7", "-1", "x", "", "GPU-a", "GPU-b"]))
# mostly what an exporter writes, so most series reach the mapping, with garbage mixed in
gpu_index = st.one_of(st.sampled_from(["0", "1", "2", "7"]), st.sampled_from(["0", "1", "2", "7"]), label_values)
gpu_uuid = st.one_of(st.sampled_from(["GPU-a", "GPU-b", "GPU-c"]), label_values)
series = st.tuples(
    st.one_of(st.sampled_from(sorted(FIELD_OF_METRIC)), st.sampled_from(["DCGM_FI_DEV_SM_CLOCK", "go_goroutines"])),
    st.fixed_dictionaries({"gpu": gpu_index}, optional={
        "UUID": gpu_uuid, "uuid": gpu_uuid, "pci_bus_id": label_values,
        "modelName": label_values, "nvlink": st.sampled_from(["0", "3"]), "GPU_I_ID": label_values,
        "err_code": label_values, "err_msg": label_values, "Hostname": label_values}),
    values)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def exposition(samples) -> str:
    lines = []
    for name, labels, value in samples:
        inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
        number = repr(value) if not math.isnan(value) else "NaN"
        number = {"inf": "+Inf", "-inf": "-Inf"}.get(number, number)
        lines.append(f"{name}{{{inner}}} {number}")
    return "\n".join(lines) + "\n"


class Exporter:
    """A real HTTP server answering /metrics with whatever body the test set last."""

    def __init__(self) -> None:
        exporter = self
        self.body = b""

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = exporter.body
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def exporter():
    server = Exporter()
    yield server
    server.close()


def check(result) -> None:
    assert result.health.source == "dcgm"
    for gpu in result.gpus:
        assert gpu.source == "dcgm" and isinstance(gpu.index, int)
        counters = [gpu.ecc.volatile_corrected, gpu.ecc.volatile_uncorrected, gpu.ecc.aggregate_corrected,
                    gpu.ecc.aggregate_uncorrected, gpu.remap.correctable, gpu.remap.uncorrectable,
                    gpu.retired_pages.single_bit, gpu.retired_pages.double_bit, gpu.pcie_replay,
                    *gpu.nvlink_errors.values()]
        assert all(c is None or (isinstance(c, int) and c >= 0) for c in counters), counters
        for gauge in (gpu.temperature_c, gpu.power_w):
            assert gauge is None or math.isfinite(gauge)
    for event in result.xids:
        assert isinstance(event.xid, int) and event.xid > 0 and event.source == "dcgm"


@FUZZ
@given(st.lists(st.lists(series, max_size=25), min_size=1, max_size=3))
def test_parseable_bodies_map_to_sane_samples(exporter, bodies):
    source = DcgmSource(exporter.url, 5.0)
    try:
        for samples in bodies:
            exporter.body = exposition(samples).encode("utf-8")
            result = source.collect(1_700_000_000.0)
            check(result)
            repeat = source.collect(1_700_000_030.0)
            check(repeat)
            assert repeat.xids == ()  # the same last-XID gauges again are no new XID
    finally:
        source.close()
