"""``ExplicitRequest``: the worker's main process, for what happens outside the handler.

A hard time limit that killed the handler is recorded (``on_timeout``), and a body of
the wrong shape is refused, not fatal:

Celery unpacks a task body as ``[args, kwargs, embed]`` while building the request in
the consumer; a body that decodes to anything else raises a ValueError there, which
Celery 5.7 treats as an unrecoverable error and stops the whole worker (and the
unacked message comes back to stop the next one). Raising InvalidTaskError instead
makes Celery reject the one message; ``django_outbox.receivers`` records it as a dead
letter with its raw body, and the worker goes on consuming.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker.request import Request

from celery_explicit import ordering, store


class ExplicitRequest(Request):
    def on_timeout(self, soft: bool, timeout: float) -> None:
        """The hard time limit killed the handler: it never reached its own records."""
        if not soft:
            store.get().record_hard_timeout(
                task_id=self.id,
                task_name=self.task_name,
                message=self.message,
                timeout=timeout,
                args=self.args,
                kwargs=self.kwargs,
            )
            # The killed job ended for good (dead-lettered, acknowledged): the next job
            # of its entity may run now, not after the ordering gap. The handler's own
            # ``finally`` never ran, so the main process passes the turn.
            place = ordering.place_in(self.request_dict)
            ordering.pass_turn_on(place, task=self.task_name, job_id=self.id)
        super().on_timeout(soft, timeout)

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(message, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            headers = getattr(message, "headers", None) or {}
            raise InvalidTaskError(
                f"body of task {headers.get('task')!r} is not [args, kwargs, embed]: {exc}"
            ) from exc
