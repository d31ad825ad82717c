"""The one poll helper of the test suite: wait for a condition with a generous deadline.

The deadline only bounds a hang (no test asserts how long anything took), so it is
long, and the poll interval is short so a test that can pass does so quickly.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition", *,
             interval: float = 0.02, retry_on: tuple[type[Exception], ...] = ()) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that value.

    ``retry_on`` lists exceptions that mean "not yet" (a server still starting refuses
    connections); the last one is named in the failure. Raises AssertionError naming ``what``
    after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            last_error, value = exc, None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                                 + (f" (last error: {last_error!r})" if last_error else ""))
        time.sleep(interval)
