"""A GPU reset as NVML shows it, read through the real nvidia-ml-py bindings against the stub
libnvidia-ml.so.1: the marks ``nvidia-smi -r`` leaves (a volatile ECC count back at zero, the
pending row remap applied, a lost GPU answering again) set ``GpuSample.reset``; growth, a first
read and an unchanged GPU do not."""

from __future__ import annotations

import pytest

from tests.support.nvml_stub import lib, run_steps, scenario  # noqa: F401 (lib, scenario: fixtures)

pytestmark = pytest.mark.integration


def _reset(result: dict, index: int) -> str:
    (gpu,) = [g for g in result["gpus"] if g["index"] == index]
    return gpu["reset"]


def test_a_volatile_ecc_count_back_at_zero_is_a_reset(lib, scenario):
    first, _, grown, _, reset, again = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "set_field", "gpu": 3, "field": "ecc_volatile_uncorrected", "value": 2},
        {"op": "collect"},
        {"op": "set_field", "gpu": 3, "field": "ecc_volatile_uncorrected", "value": 0},
        {"op": "collect"},
        {"op": "collect"},
    ])
    assert [_reset(r, 3) for r in (first, grown)] == ["", ""]  # a first read and growth are no reset
    assert _reset(reset, 3) == "the volatile uncorrected ECC count went from 2 to 0"
    assert [_reset(reset, i) for i in range(8) if i != 3] == [""] * 7
    assert _reset(again, 3) == ""  # said once, for the read that saw it


def test_the_pending_row_remap_applied_is_a_reset(lib, scenario):
    *_, pending, _, applied = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "set_field", "gpu": 5, "field": "remap_pending", "value": True},
        {"op": "collect"},
        {"op": "set_field", "gpu": 5, "field": "remap_pending", "value": False},
        {"op": "collect"},
    ])
    assert _reset(pending, 5) == ""
    assert _reset(applied, 5) == "the row remap that was pending is applied"


def test_a_lost_gpu_that_answers_again_was_reset(lib, scenario):
    _, _, lost, _, back = run_steps(lib, scenario, [
        {"op": "collect"},
        {"op": "set_lost", "gpu": 2},
        {"op": "collect"},
        {"op": "set_lost", "gpu": 2, "lost": False},
        {"op": "collect"},
    ])
    assert _reset(lost, 2) == ""
    assert _reset(back, 2) == "the GPU answers again after NVML reported it lost"


def test_a_reset_is_not_said_again_for_a_gpu_whose_identity_cannot_be_read_next(lib, scenario):
    """After the read that saw the reset, NVML refuses GPU 3's handle: the sample kept from the last
    read stands in for it, and it must not carry that reset again (a new fault on the GPU would be
    closed by an old reset, and its quarantine lifted)."""
    *_, reset, _, refused, again = run_steps(lib, scenario, [
        {"op": "set_field", "gpu": 3, "field": "ecc_volatile_uncorrected", "value": 2},
        {"op": "collect"},
        {"op": "set_field", "gpu": 3, "field": "ecc_volatile_uncorrected", "value": 0},
        {"op": "collect"},
        {"op": "deny_handle", "gpu": 3},
        {"op": "collect"},
        {"op": "collect"},
    ])
    assert _reset(reset, 3) == "the volatile uncorrected ECC count went from 2 to 0"
    assert _reset(refused, 3) == "" and _reset(again, 3) == ""
