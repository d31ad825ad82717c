"""Fixtures for the training tests: ``agent``, an agent serving /metrics and the intake."""

from tests.telemetry.harness import agent  # noqa: F401 (a fixture)
