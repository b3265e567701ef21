"""A consumer bootstep that dead-letters messages whose body does not decode.

The Redis transport decodes a message's body in the worker's main process, before any
task code runs; Celery's ``Consumer.on_decode_error`` then logs it and acks it, and
the message is gone. This step wraps that method so the message becomes a dead letter
(reason ``bad_input``, raw body kept) before the ack. ``ExplicitTask.on_bound`` adds
the step to every app an ExplicitTask is bound to.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps


class RecordUndecodable(bootsteps.StartStopStep):
    label = "celery_explicit: dead-letter undecodable messages"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        original = parent.on_decode_error

        def on_decode_error(message: Any, exc: BaseException) -> None:
            from django_outbox import receivers

            headers = getattr(message, "headers", None) or {}
            receivers.record_undecodable(
                task_id=headers.get("id"),
                task_name=str(headers.get("task") or "?"),
                message=message,
                error=exc,
            )
            original(message, exc)

        parent.on_decode_error = on_decode_error


def install(app: Any) -> None:
    """Add the step to ``app``'s consumer blueprint (idempotent: steps are a set)."""
    app.steps["consumer"].add(RecordUndecodable)
