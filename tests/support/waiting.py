"""Waiting for something another process does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
    on_timeout: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy; its value is returned.

    On timeout a ``TimeoutError`` names ``what``, the last value and, if given, what
    ``on_timeout()`` returns (a log tail, the state of a table).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            context = f"; context: {on_timeout()!r}" if on_timeout else ""
            raise TimeoutError(
                f"timed out after {timeout}s waiting for {what} (last value {value!r}){context}"
            )
        time.sleep(interval)
