"""Fixtures for the telemetry tests (the harness itself is tests/telemetry/harness.py)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.telemetry.harness import RunningAgent, start_agent


@pytest.fixture
def agent() -> Iterator[RunningAgent]:
    running = start_agent()
    yield running
    running.server.stop()
