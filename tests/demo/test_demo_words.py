"""What ``healthagent demo`` says first and what it says about the grace: a friendly first screen
(the stub NVML library is the demo's own, said in its header, not a warning) and timing words
that agree with the time the demo measured."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from healthagent.demo.script import DEMO_EFFECTS_PASS_SECONDS, DEMO_GRACE_SECONDS, no_execute_words
from tests.support.nvml_stub import NO_CC

REPO = Path(__file__).parents[2]


@pytest.mark.integration
def test_the_first_line_is_the_demos_header_not_a_warning():
    if shutil.which("cc") is None:
        pytest.skip(NO_CC)
    done = subprocess.run([sys.executable, "-m", "healthagent", "demo", "--xid", "13"], capture_output=True,
                          text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith("healthagent demo: a p5.48xlarge-shaped node (8 x H100 "
                                                  "answered by the stub NVML library the demo builds")
    assert "stub" not in done.stderr and "WARNING" not in done.stderr.split("\n", 1)[0]


@pytest.mark.parametrize("seconds", [DEMO_GRACE_SECONDS, DEMO_GRACE_SECONDS + DEMO_EFFECTS_PASS_SECONDS,
                                     DEMO_GRACE_SECONDS + 1.2])
def test_noexecute_on_time_is_the_grace_then_the_next_pass(seconds):
    words = no_execute_words(seconds)
    assert f"{seconds:.1f} s after the demo saw NoSchedule" in words
    assert f"(the {DEMO_GRACE_SECONDS:g} s grace, then the effects' next pass)" in words


def test_noexecute_late_says_the_machine_was_busy_instead_of_contradicting_the_grace():
    words = no_execute_words(DEMO_GRACE_SECONDS + 2.0)
    assert f"{DEMO_GRACE_SECONDS + 2.0:.1f} s after" in words and "came late on this busy machine" in words
