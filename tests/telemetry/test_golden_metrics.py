"""Golden files: the whole ``/metrics`` of the demo node in a fixed state, byte for byte.

Like node_exporter's end-to-end test: one scrape of a known node, compared with a committed file,
so any change a scraper would see (a renamed metric, a label, a help text, ordering, number
formatting, a series that appears or vanishes) shows up as a diff in review. The fixed state
(the real agent on the demo node, XID 94 on GPU 3 with its ECC and row-remap counters, Kubernetes
in dry-run, a training job, every clock fixed) is built by ``tests/support/golden_metrics.py``,
in a fresh interpreter per run.

After an intended change, regenerate from the repo root and review the diff:

    python -m tests.fixtures.metrics.regenerate
    git diff tests/fixtures/metrics/
"""

from __future__ import annotations

import shutil

import pytest

from tests.support.golden_metrics import GOLDEN_FILES, GoldenFile, golden_mismatch, render_in_fresh_process
from tests.telemetry.contract import parse, sample_value
from tests.support.nvml_stub import NO_CC

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """One render of every format (a few seconds: a fresh interpreter, the stub compiled once)."""
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    return render_in_fresh_process(cache_dir=tmp_path_factory.mktemp("golden-cache"))


@pytest.mark.parametrize("golden", GOLDEN_FILES, ids=lambda g: g.name)
def test_the_demo_node_scrape_is_the_golden_file(scraped: dict[str, bytes], golden: GoldenFile) -> None:
    problem = golden_mismatch(golden, scraped[golden.name])
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def test_the_golden_file_shows_the_scripted_state() -> None:
    """A regenerated file is reviewed, but a broken run must not be baked in unnoticed: the
    committed text file must show the state the script builds."""
    families = parse(GOLDEN_FILES[0].path.read_text(encoding="utf-8"))
    every = [s for _, _, samples in families.values() for s in samples]
    up = [s for s in every if s.name == "healthagent_gpu_up"]
    assert len(up) == 8 and all(s.value == 1 for s in up)
    assert sample_value(every, "healthagent_efa_devices") == 32
    assert sample_value(every, "healthagent_xid_errors_total", gpu="3",
                        uuid="GPU-17f288f1-eb60-1974-c795-3c81e8775f30", xid="94") == 1
    assert sample_value(every, "healthagent_node_action", action="replace_node") == 1
    assert sample_value(every, "healthagent_node_taint_applied") == 1
    assert {s.labels["source"]: s.value for s in every if s.name == "healthagent_source_up"} == {
        "efa": 1, "kmsg": 1, "nvml": 1, "pcie_aer": 1, "rdma": 1}
    assert sample_value(every, "healthagent_scaling_events_total", job="llama-golden",
                        direction="down", reason="fault") == 1
