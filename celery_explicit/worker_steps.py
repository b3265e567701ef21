"""Our consumer bootsteps, added to each Celery app once.

- ``LeaseKeeper`` (``celery_explicit.lease``): extends each held message's visibility
  lease and each running handler's execution lease.
- ``RecordUndecodable`` (below): the Redis transport decodes a message's body in the
  worker's main process, before any task code runs; Celery's
  ``Consumer.on_decode_error`` then logs it and acks it, and the message is gone. The
  step wraps that method so the message becomes a dead letter (reason ``bad_input``,
  raw body kept) before the ack.

Bootsteps are Celery's documented extension point for the consumer
(https://docs.celeryq.dev/en/stable/userguide/extending.html#consumer-bootsteps);
``app.steps["consumer"]`` is a set, read when the worker builds its consumer.
``ExplicitTask.on_bound`` calls ``install`` for the app a task is bound to; the
first call per app adds the steps, later ones do nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

from celery import bootsteps

from celery_explicit import store
from celery_explicit.lease import LeaseKeeper

_installed: weakref.WeakSet[Any] = weakref.WeakSet()


class RecordUndecodable(bootsteps.StartStopStep):
    label = "celery_explicit: dead-letter undecodable messages"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        # Celery has no hook for an undecodable body; this wraps the bound method
        # the consumer calls (celery/worker/consumer/consumer.py, Consumer.
        # on_decode_error, called from create_task_handler: https://github.com/celery/
        # celery/blob/v5.5.0/celery/worker/consumer/consumer.py). tests/integration/
        # test_upstream_seams.py fails if upstream renames or stops calling it.
        original = parent.on_decode_error

        def on_decode_error(message: Any, exc: BaseException) -> None:
            headers = getattr(message, "headers", None) or {}
            store.get().record_undecodable(
                task_id=headers.get("id"),
                task_name=str(headers.get("task") or "?"),
                message=message,
                error=exc,
            )
            original(message, exc)

        parent.on_decode_error = on_decode_error


def install(app: Any) -> None:
    """Add our consumer steps to ``app`` (once per app)."""
    if app in _installed:
        return
    app.steps["consumer"].add(RecordUndecodable)
    app.steps["consumer"].add(LeaseKeeper)
    _installed.add(app)
