"""The correlation id: the request that caused a job, carried to every job it causes.

It is born at the first publish (a fresh id), or taken from the caller's context: a
web request's ``X-Request-ID`` through ``django_outbox.middleware.CorrelationMiddleware``,
or any code that wraps its work in ``correlation.use(request_id)``. From there it
travels in the ``correlation_id`` message header: through an on_commit dispatch
(captured when ``dispatch()`` is called, not when the transaction commits), through an
outbox row's headers and the relay, into the task; and while the task runs it is the
current one, so every job its handler publishes carries it too. Attempts, dead letters
and log lines store it, and the admin's search finds every attempt by it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token

_current: ContextVar[str] = ContextVar("explicit_correlation_id", default="")

#: Longest id kept (the attempt row's column); a longer one is cut, not refused.
MAX_LENGTH = 255


def new() -> str:
    return uuid.uuid4().hex


def current() -> str:
    """The correlation id of the code running now, or ``""`` outside any."""
    return _current.get()


def for_publish() -> str:
    """What a new message carries: the current id, else a new one (born here)."""
    return _current.get() or new()


@contextmanager
def use(correlation_id: str) -> Iterator[str]:
    """Make ``correlation_id`` current in this block (a new one if empty)."""
    token = bind(correlation_id or new())
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def bind(correlation_id: str) -> Token[str]:
    """Make ``correlation_id`` current until ``reset(token)`` (the worker's delivery)."""
    return _current.set(str(correlation_id)[:MAX_LENGTH])


def reset(token: Token[str]) -> None:
    _current.reset(token)
