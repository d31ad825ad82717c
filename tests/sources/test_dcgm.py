"""DcgmSource against a real HTTP server on 127.0.0.1 serving dcgm-exporter texts.

Fixtures (``tests/fixtures/dcgm/``) follow the exporter's own template
(``{gpu, UUID|uuid, pci_bus_id, device, modelName, [GPU_I_PROFILE, GPU_I_ID], Hostname, labels,
attributes}``) in three generations: 2.x without ``pci_bus_id``, 3.3 with ``pci_bus_id``,
``DCGM_FI_DRIVER_VERSION`` and ``err_code``/``err_msg``, and MIG with per-instance series.
"""

from __future__ import annotations

import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from healthagent.sources.dcgm import DcgmSource, throttle_reason_names

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent.parent / "fixtures" / "dcgm"
NOW = 1_700_000_000.0
HOLD_LIMIT_SECONDS = 30.0  # the slow route's own bound, so a broken test cannot hang the suite
PROM_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


class Exporter:
    """A real HTTP server standing in for dcgm-exporter: routes are (status, content type, body)
    or one of the misbehaviours ``hold`` (answer only after ``release`` is set), ``truncate``
    (promise more bytes than it sends, then close) and ``eof`` (no length, cut mid-line)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple] = {}
        self.release = threading.Event()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                try:
                    self._answer()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (the timeout test): that is the point

            def _answer(self):
                route = exporter.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                kind = route[0]
                if kind == "hold":
                    exporter.release.wait(HOLD_LIMIT_SECONDS)
                    route = ("ok", 200, PROM_TEXT, route[1])
                    kind = "ok"
                if kind == "ok":
                    _, status, content_type, body = route
                    data = body.encode() if isinstance(body, str) else body
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif kind == "truncate":
                    data = route[1].encode()
                    self.send_response(200)
                    self.send_header("Content-Type", PROM_TEXT)
                    self.send_header("Content-Length", str(len(data) * 2))
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                    self.close_connection = True
                elif kind == "eof":
                    self.protocol_version = "HTTP/1.0"
                    self.send_response(200)
                    self.send_header("Content-Type", PROM_TEXT)
                    self.end_headers()
                    self.wfile.write(route[1].encode())
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def serve(self, path: str, body: str | bytes, status: int = 200, content_type: str = PROM_TEXT) -> str:
        self.routes[path] = ("ok", status, content_type, body)
        return self.url(path)


@pytest.fixture
def exporter():
    server = Exporter()
    server.thread.start()
    yield server
    server.release.set()
    server.server.shutdown()
    server.server.server_close()


def scrape(exporter, body: str):
    """One collect from a fresh source of an exporter serving ``body``."""
    return DcgmSource(exporter.serve("/m", body), 2.0).collect(NOW)


def gpus_by_index(result):
    return {g.index: g for g in result.gpus}


_XID_GAUGE = re.compile(r"^((?:DCGM_FI_DEV_XID_ERRORS|dcgm_xid_errors)\{[^}]*\}) \d+$", re.M)


def zero_xids(text: str) -> str:
    """``text`` with every last-XID gauge at 0 (what the exporter serves before any XID)."""
    return _XID_GAUGE.sub(r"\1 0", text)


def scrape_after_baseline(exporter, body: str):
    """The second collect of a source that first saw ``body`` with every XID gauge at 0, so the
    gauge values of ``body`` are changes (the first scrape is a baseline, never an event)."""
    source = DcgmSource(exporter.serve("/m", zero_xids(body)), 2.0)
    baseline = source.collect(NOW - 30)
    assert baseline.health.up is True and baseline.xids == ()
    exporter.serve("/m", body)
    return source.collect(NOW)


# -- formats -------------------------------------------------------------------------------------

def test_new_format_maps_every_health_field(exporter):
    result = scrape_after_baseline(exporter, fixture("dcgm-exporter-3.3-h100x8.txt"))
    assert result.health.up is True
    assert result.health.errors == {}
    gpus = gpus_by_index(result)
    assert sorted(gpus) == list(range(8))
    g0, g1, g2, g4, g5, g6, g7 = (gpus[i] for i in (0, 1, 2, 4, 5, 6, 7))
    assert g0.source == "dcgm"
    assert g0.uuid == "GPU-8f6d2c1a-5b3e-4d7f-9a10-2c4e6f8a0b1c"
    assert g0.pci_bus_id == "0000:53:00.0"
    assert g5.pci_bus_id == "0000:a8:00.0"  # NVML's 00000000:A8:00.0, canonical
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.driver_version == "535.183.01"
    assert g0.timestamp == NOW
    assert (g0.temperature_c, g7.temperature_c) == (41.0, 48.0)
    assert g1.power_w == pytest.approx(515.75)
    assert (g2.ecc.volatile_corrected, g2.ecc.aggregate_corrected) == (3, 17)
    assert (g2.ecc.volatile_uncorrected, g2.ecc.aggregate_uncorrected) == (0, 0)
    assert g5.ecc.aggregate_uncorrected == 1
    assert (g5.remap.uncorrectable, g5.remap.correctable, g5.remap.pending, g5.remap.failure) == (1, 0, True, False)
    assert (g0.remap.pending, g0.remap.failure) == (False, False)
    assert (g0.retired_pages.single_bit, g0.retired_pages.double_bit, g0.retired_pages.pending) == (0, 0, False)
    assert g6.pcie_replay == 2
    assert dict(g1.nvlink_errors) == {"crc_flit": 12, "crc_data": 0, "replay": 4, "recovery": 0}
    assert g7.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert g4.throttle_reasons == ("gpu_idle",)
    assert g0.throttle_reasons == ()
    assert g0.lost is False
    # GPU 5's last-XID gauge went 0 -> 94 after the baseline: one event.
    (event,) = result.xids
    assert (event.xid, event.gpu_index, event.uuid, event.pci_bus_id) == (
        94, 5, "GPU-5e70a1b2-3e4f-4051-b273-8495a6b7c8d9", "0000:a8:00.0")
    assert event.source == "dcgm"
    assert event.message == "Contained ECC error"
    assert event.line.startswith('DCGM_FI_DEV_XID_ERRORS{gpu="5",') and event.line.endswith("} 94")
    assert 'err_code="94"' in event.line
    assert event.timestamp == NOW


def test_old_format_without_pci_bus_id(exporter):
    result = scrape_after_baseline(exporter, fixture("dcgm-exporter-2.x-a100x2.txt"))
    assert result.health.up is True and result.health.errors == {}
    g0, g1 = result.gpus
    assert (g0.index, g0.uuid, g0.name) == (0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "A100-SXM4-80GB")
    assert g0.pci_bus_id == "" and g0.driver_version == ""
    assert g0.throttle_reasons == ("gpu_idle",)
    assert g1.throttle_reasons == ("sw_thermal_slowdown", "hw_thermal_slowdown")  # old field name
    assert g1.temperature_c == 88.0 and g1.power_w == pytest.approx(398.512)
    assert g1.ecc == type(g1.ecc)(volatile_corrected=2, volatile_uncorrected=1, aggregate_corrected=40,
                                  aggregate_uncorrected=1)
    assert (g1.retired_pages.single_bit, g1.retired_pages.double_bit, g1.retired_pages.pending) == (2, 1, True)
    assert (g1.remap.pending, g1.remap.failure) == (None, False)  # 2.x has no pending field
    assert g1.nvlink_errors == {}
    (event,) = result.xids
    assert (event.xid, event.gpu_index, event.pci_bus_id, event.message) == (48, 1, "", "")


def test_mig_series_lowercase_labels_and_nvswitch(exporter):
    result = scrape_after_baseline(exporter, fixture("dcgm-exporter-3.3-mig.txt"))
    assert result.health.errors == {}
    (gpu,) = result.gpus  # three instances of one GPU, one NVSwitch series: one GPU
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (0, "GPU-265c9814-6156-355b-e589-ff2064894f16", "0000:c5:00.0")
    assert gpu.temperature_c == 52.0
    assert gpu.ecc.volatile_uncorrected == 0 and gpu.ecc.aggregate_uncorrected is None
    (event,) = result.xids  # one event per GPU, not one per instance
    assert (event.xid, event.gpu_instance) == (31, 3)


@pytest.mark.parametrize("labels", [
    'gpu="0",UUID="GPU-x",device="nvidia0",modelName="H100",Hostname="n1"',
    'gpu="0",UUID="GPU-x",device="nvidia0",modelName="H100",hostname="n1"',
    'gpu="0",uuid="GPU-x",device="nvidia0",modelName="H100"',
    'gpu="0", UUID="GPU-x",container="",namespace="",pod=""',
])
def test_label_set_variants(exporter, labels):
    body = (f"# TYPE DCGM_FI_DEV_ECC_DBE_AGG_TOTAL counter\nDCGM_FI_DEV_ECC_DBE_AGG_TOTAL{{{labels}}} 2\n"
            f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} 9223372036854775794\n")
    (gpu,) = scrape(exporter, body).gpus
    assert (gpu.index, gpu.uuid, gpu.ecc.aggregate_uncorrected) == (0, "GPU-x", 2)
    assert gpu.temperature_c is None  # DCGM's blank sentinel: not supported


def test_one_x_compatibility_names(exporter):
    body = ('# TYPE dcgm_ecc_dbe_aggregate_total counter\n'
            'dcgm_ecc_dbe_aggregate_total{gpu="1",uuid="GPU-y"} 3\n'
            'dcgm_xid_errors{gpu="1",uuid="GPU-y"} 79\n'
            'dcgm_gpu_temp{gpu="1",uuid="GPU-y"} 60\n')
    result = scrape_after_baseline(exporter, body)
    (gpu,) = result.gpus
    assert (gpu.index, gpu.ecc.aggregate_uncorrected, gpu.temperature_c) == (1, 3, 60.0)
    assert [e.xid for e in result.xids] == [79]


@pytest.mark.parametrize("metric, read", [
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", lambda g: g.ecc.volatile_corrected),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", lambda g: g.ecc.volatile_uncorrected),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", lambda g: g.ecc.aggregate_corrected),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", lambda g: g.ecc.aggregate_uncorrected),
    ("dcgm_ecc_sbe_volatile_total", lambda g: g.ecc.volatile_corrected),
    ("dcgm_ecc_dbe_volatile_total", lambda g: g.ecc.volatile_uncorrected),
    ("dcgm_ecc_sbe_aggregate_total", lambda g: g.ecc.aggregate_corrected),
    ("dcgm_ecc_dbe_aggregate_total", lambda g: g.ecc.aggregate_uncorrected),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", lambda g: g.remap.correctable),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", lambda g: g.remap.uncorrectable),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", lambda g: g.remap.pending),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", lambda g: g.remap.failure),
    ("DCGM_FI_DEV_RETIRED_SBE", lambda g: g.retired_pages.single_bit),
    ("DCGM_FI_DEV_RETIRED_DBE", lambda g: g.retired_pages.double_bit),
    ("DCGM_FI_DEV_RETIRED_PENDING", lambda g: g.retired_pages.pending),
    ("dcgm_retired_pages_sbe", lambda g: g.retired_pages.single_bit),
    ("dcgm_retired_pages_dbe", lambda g: g.retired_pages.double_bit),
    ("dcgm_retired_pages_pending", lambda g: g.retired_pages.pending),
])
def test_each_health_field_name_alone_observes_the_gpu(exporter, metric, read):
    """Every name the exporter versions give a health field, as the only field of a custom list."""
    kind = "counter" if metric.lower().endswith("total") else "gauge"
    result = scrape(exporter, f"# TYPE {metric} {kind}\n{metric}{{gpu=\"0\",UUID=\"GPU-a\"}} 1\n")
    assert result.health.up is True and result.health.unobserved == ()
    (gpu,) = result.gpus
    assert read(gpu) in (1, True)


def test_gpus_listed_without_a_health_field_are_named_unobserved_beside_the_observed(exporter):
    body = ('DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a"} 0\n'
            'DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-a"} 1980\n'
            'DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-b"} 1980\n')
    result = scrape(exporter, body)
    assert result.health.up is True and [g.uuid for g in result.gpus] == ["GPU-a"]
    assert result.health.unobserved == ("GPU 1 (GPU-b)",)
    assert "not carried by the exporter: ECC, row remapping, retired pages" in result.health.detail


def test_the_exporters_xid_counters_count_new_xids_and_survive_its_restart(exporter):
    labels = 'gpu="0",UUID="GPU-a"'
    source = DcgmSource(exporter.serve("/m", f'DCGM_EXP_XID_ERRORS_TOTAL{{{labels},xid="13"}} 40\n'), 2.0)
    assert source.collect(NOW).xids == ()  # the baseline: 40 XID 13s from before
    exporter.serve("/m", f'DCGM_EXP_XID_ERRORS_TOTAL{{{labels},xid="13"}} 41\n'
                         f'DCGM_EXP_XID_ERRORS_TOTAL{{{labels},xid="94"}} 1\n')  # a series that appears is new
    assert sorted((e.xid, e.repeats) for e in source.collect(NOW + 10).xids) == [(13, 1), (94, 1)]
    exporter.serve("/m", f'DCGM_EXP_XID_ERRORS_TOTAL{{{labels},xid="13"}} 2\n')  # the exporter restarted
    assert [(e.xid, e.repeats) for e in source.collect(NOW + 20).xids] == [(13, 2)]
    window = DcgmSource(exporter.serve("/w", f'DCGM_EXP_XID_ERRORS_COUNT{{{labels}}} 0\n'), 2.0)
    assert window.collect(NOW).xids == () and window.collect(NOW).gpus  # no XID yet, yet observed
    exporter.serve("/w", f'DCGM_EXP_XID_ERRORS_COUNT{{{labels},xid="79"}} 2\n')
    assert [(e.xid, e.repeats) for e in window.collect(NOW + 10).xids] == [(79, 2)]
    exporter.serve("/w", f'DCGM_EXP_XID_ERRORS_COUNT{{{labels},xid="79"}} 1\n')  # one left the window
    assert window.collect(NOW + 20).xids == ()


@pytest.mark.parametrize("mask, names", [
    (0, ()),
    (0x1, ("gpu_idle",)),
    (0x4 | 0x80, ("sw_power_cap", "hw_power_brake_slowdown")),
    (0x1FF, ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
             "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")),
    (0x400 | 0x8, ("hw_slowdown",)),  # a bit NVML does not name is left out, as NVML's source does
])
def test_throttle_reason_names(mask, names):
    assert throttle_reason_names(mask) == names


# -- XID gauge -> events -------------------------------------------------------------------------

def with_xids(text: str, xids: dict[int, int]) -> str:
    """The 3.3 fixture with GPU i's last-XID gauge (value and err_code label) set to xids[i]."""
    def line(match):
        gpu, value = int(match.group(1)), xids.get(int(match.group(1)), 0)
        return re.sub(r'err_code="\d+",err_msg="[^"]*"\} \d+$',
                      f'err_code="{value}",err_msg="Error {value}"}} {value}', match.group(0))
    return re.sub(r'^DCGM_FI_DEV_XID_ERRORS\{gpu="(\d+)".*$', line, text, flags=re.M)


def test_each_new_xid_value_is_one_event(exporter):
    base = fixture("dcgm-exporter-3.3-h100x8.txt")
    source = DcgmSource(exporter.url("/metrics"), 2.0)
    steps = [  # (gauge values served, events expected as (gpu, xid))
        ({}, []),
        ({}, []),                                   # unchanged: nothing
        ({3: 79}, [(3, 79)]),                       # a new XID on GPU 3
        ({3: 79}, []),                              # still 79: dcgm cannot show a repeat
        ({3: 79, 5: 95}, [(5, 95)]),
        ({3: 13, 5: 94}, [(3, 13), (5, 94)]),       # two GPUs change in one scrape
        ({3: 0, 5: 94}, []),                        # back to 0 is no event
        ({3: 13, 5: 94}, [(3, 13)]),                # 0 -> 13 is a new XID
    ]
    for served, expected in steps:
        exporter.serve("/metrics", with_xids(base, served))
        result = source.collect(NOW)
        assert result.health.up is True
        assert [(e.gpu_index, e.xid) for e in result.xids] == expected, served


def test_nonzero_gauge_at_start_is_a_baseline_not_an_event(exporter):
    base = fixture("dcgm-exporter-3.3-h100x8.txt")
    exporter.serve("/metrics", with_xids(base, {2: 94, 6: 79}))
    first = DcgmSource(exporter.url("/metrics"), 2.0).collect(NOW)
    assert first.health.up is True and first.xids == ()
    assert first.health.errors == {"baseline": 2}  # GPU 2's 94 and GPU 6's 79, counted, not events
    # An agent restart is a new source against the same exporter: the stale 94 is not new again.
    restarted = DcgmSource(exporter.url("/metrics"), 2.0)
    assert restarted.collect(NOW + 600).xids == ()
    # Only a later change is an event.
    exporter.serve("/metrics", with_xids(base, {2: 94, 6: 48}))
    assert [(e.gpu_index, e.xid) for e in restarted.collect(NOW + 630).xids] == [(6, 48)]


def test_baseline_survives_failures_so_an_outage_does_not_replay_it(exporter):
    base = fixture("dcgm-exporter-3.3-h100x8.txt")
    exporter.serve("/metrics", with_xids(base, {2: 94}))
    source = DcgmSource(exporter.url("/metrics"), 2.0)
    assert source.collect(NOW).xids == ()
    exporter.serve("/metrics", "oops", status=500)
    failed = source.collect(NOW + 30)
    assert (failed.health.up, failed.xids, failed.gpus) == (False, (), ())
    exporter.serve("/metrics", "cut mid-line DCGM_FI_DEV_XID_ERRORS{gpu=")
    assert source.collect(NOW + 60).xids == ()
    exporter.serve("/metrics", with_xids(base, {2: 94}))
    recovered = source.collect(NOW + 90)
    assert recovered.health.up is True
    assert recovered.xids == ()  # the same 94, seen before the outage: not new
    assert recovered.health.errors == {"baseline": 1, "http_5xx": 1, "parse": 1}


# -- failures ------------------------------------------------------------------------------------

def test_http_500_is_counted_and_down(exporter):
    source = DcgmSource(exporter.serve("/metrics", "internal error\n", status=500), 2.0)
    result = source.collect(NOW)
    assert result.health.up is False
    assert result.health.detail.startswith("HTTP 500")
    assert result.health.errors == {"http_5xx": 1}
    assert source.collect(NOW + 30).health.errors == {"http_5xx": 2}


def test_http_404_is_counted(exporter):
    result = DcgmSource(exporter.url("/nothing-here"), 2.0).collect(NOW)
    assert (result.health.up, result.health.errors) == (False, {"http_4xx": 1})


def test_timeout_when_the_exporter_holds_its_reply(exporter):
    exporter.routes["/slow"] = ("hold", fixture("dcgm-exporter-3.3-h100x8.txt"))
    source = DcgmSource(exporter.url("/slow"), 0.3)
    result = source.collect(NOW)
    exporter.release.set()
    assert result.health.up is False
    assert result.health.errors == {"timeout": 1}
    assert "0.3" in result.health.detail


def test_connection_refused():
    with socket.socket() as sock:  # bound, never listening: the kernel refuses connections
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        result = DcgmSource(f"http://127.0.0.1:{port}/metrics", 1.0).collect(NOW)
    assert result.health.up is False
    assert result.health.errors == {"connect": 1}
    assert "cannot connect" in result.health.detail


def test_invalid_url_never_raises():
    result = DcgmSource("not a url", 1.0).collect(NOW)
    assert result.health.up is False
    assert result.health.errors == {"connect": 1}


@pytest.mark.parametrize("route, why", [
    (("truncate", "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\nDCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-a\"} 40\n"),
     "truncated"),
    (("eof", "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\nDCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-a\"} 4"),
     "no final newline"),
    (("ok", 200, PROM_TEXT, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\n"), "UTF-8"),
    (("ok", 200, "text/html; charset=utf-8", "<html><body>login</body></html>\n"), "Content-Type"),
    (("ok", 200, PROM_TEXT, '{"gpus": [1, 2]}\n'), "not Prometheus text"),
    (("ok", 200, PROM_TEXT, 'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a"} hot\n'), "not Prometheus text"),
])
def test_bad_bodies_are_parse_errors(exporter, route, why):
    exporter.routes["/bad"] = route
    source = DcgmSource(exporter.url("/bad"), 2.0)
    result = source.collect(NOW)
    assert result.health.up is False
    assert result.health.errors == {"parse": 1}
    assert why in result.health.detail
    assert result.gpus == () and result.xids == ()


def test_an_empty_body_lists_no_gpu_so_the_gpus_are_unobserved_not_healthy(exporter):
    result = scrape(exporter, "")
    assert (result.health.up, result.gpus, result.health.errors) == (False, (), {"no_gpus": 1})
    assert "lists no GPU" in result.health.detail


def test_nonsense_values_are_counted_not_raised(exporter):
    body = ('DCGM_FI_DEV_ECC_DBE_AGG_TOTAL{gpu="0",UUID="GPU-a"} -4\n'
            'DCGM_FI_DEV_ECC_SBE_AGG_TOTAL{gpu="0",UUID="GPU-a"} NaN\n'
            'DCGM_FI_DEV_GPU_TEMP{gpu="zero",UUID="GPU-b"} 40\n'
            'DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="0",UUID="GPU-a"} 7\n')
    result = scrape(exporter, body)
    (gpu,) = result.gpus
    assert gpu.ecc.aggregate_uncorrected is None and gpu.ecc.aggregate_corrected is None
    assert gpu.pcie_replay == 7
    assert result.health.up is True
    assert result.health.errors == {"parse": 3}


# -- properties ----------------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


class _Offline(DcgmSource):
    """The source with its HTTP fetch replaced by a given body: for checking the mapping alone
    against arbitrary text (the HTTP side is covered by the server tests above)."""

    body = ""

    def _fetch(self) -> str:
        return self.body


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}",=\\# \n\tgpuUIDxXE0159.-+_aN', max_size=300))
def test_any_text_is_a_result_never_an_exception(body):
    source = _Offline("http://127.0.0.1:9/metrics", 1.0)
    source.body = body
    result = source.collect(NOW)
    assert result.health.up or result.health.errors  # down always says why, counted
    for gpu in result.gpus:
        assert gpu.source == "dcgm"
