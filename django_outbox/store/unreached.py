"""Worker main process: dead-letter messages that never reach a task's code.

Celery drops a message naming an unknown task (it logs and rejects it) and acks a
body that does not decode. Both are bad input we must not lose: each becomes a dead
letter with the raw message, and the worker goes on consuming.
"""

from __future__ import annotations

import json
from typing import Any

from celery import signals
from django.db import DatabaseError

from celery_explicit import job_log, metrics
from celery_explicit.errors import qualname
from celery_explicit.headers import CORRELATION_HEADER, KEY_HEADER
from celery_explicit.request import nested_deeper_than
from django_outbox.models import DeadLetterReason
from django_outbox.store import dead_letters

logger = job_log.get_logger("django_outbox.store.unreached")


def _body_text(message: Any) -> str:
    body = getattr(message, "body", b"")
    if isinstance(body, bytes):
        return body.decode("utf-8", errors="backslashreplace")
    return str(body)


def _args_from_body(text: str) -> tuple[Any, Any]:
    try:
        decoded = json.loads(text)
        args, kwargs = decoded[0], decoded[1]
    except (ValueError, TypeError, IndexError, KeyError, RecursionError):
        # RecursionError: a body nested deeper than json can decode is still recorded,
        # raw, without its arguments.
        return [], {}
    if nested_deeper_than(args) or nested_deeper_than(kwargs):
        # Refused for its depth (celery_explicit.request.MAX_NESTING): encoding its
        # arguments as JSON for the record could run out of stack; the raw body is kept.
        return [], {}
    if isinstance(args, list) and isinstance(kwargs, dict):
        return args, kwargs
    return [], {}


def _record(
    *,
    task_id: Any,
    task_name: str,
    message: Any,
    error_class: str,
    error_message: str,
    reason: DeadLetterReason = DeadLetterReason.BAD_INPUT,
    args: Any = None,
    kwargs: Any = None,
) -> None:
    headers = dict(getattr(message, "headers", None) or {})
    raw = _body_text(message)
    if args is None:
        args, kwargs = _args_from_body(raw)
    try:
        dead_letters.record(
            task_id=task_id,
            task_name=task_name,
            reason=reason,
            args=args,
            kwargs=kwargs,
            raw_body=raw,
            idempotency_key=str(headers.get(KEY_HEADER) or ""),
            error_class=error_class,
            error_message=error_message,
            correlation_id=str(headers.get(CORRELATION_HEADER) or ""),
            queue=str((getattr(message, "delivery_info", None) or {}).get("routing_key") or ""),
            exchange=str((getattr(message, "delivery_info", None) or {}).get("exchange") or ""),
        )
    except DatabaseError:
        # Celery has already rejected (or is about to ack) the message; the log line is
        # then the only copy, so it carries the whole body.
        logger.exception(
            "could not dead-letter a message; its body follows",
            extra={"task": task_name, "job_id": task_id, "raw_body": raw},
        )
        return
    metrics.dead_letters.labels(task_name, reason.value).inc()


@signals.task_unknown.connect
def record_unknown_task(
    sender: Any = None,
    message: Any = None,
    exc: Any = None,
    name: str | None = None,
    id: str | None = None,
    **_: Any,
) -> None:
    _record(
        task_id=id,
        task_name=str(name or "?"),
        message=message,
        # One word for one cause, whether the worker or the relay meets it.
        reason=DeadLetterReason.UNKNOWN_TASK,
        error_class="celery.exceptions.NotRegistered",
        error_message=f"unknown task name {name!r}: no task with this name is "
        "registered in the worker that received it",
    )


def record_undecodable(
    *, task_id: str | None, task_name: str, message: Any, error: BaseException
) -> None:
    _record(
        task_id=task_id,
        task_name=task_name,
        message=message,
        error_class=qualname(error),
        error_message=f"message body for task {task_name} does not decode: {error}",
    )


@signals.task_rejected.connect
def record_rejected(sender: Any = None, message: Any = None, exc: Any = None, **_: Any) -> None:
    """A message Celery refused before any task ran: not a task message, or content
    this worker does not accept (a pickled body when only JSON is accepted)."""
    headers = dict(getattr(message, "headers", None) or {})
    name = str(headers.get("task") or "?")
    reason = (
        f"message refused by the worker: {exc}"
        if exc is not None
        else "message is not a Celery task message (no task name header)"
    )
    _record(
        task_id=headers.get("id"),
        task_name=name,
        message=message,
        error_class=qualname(exc),
        error_message=f"{reason}; task {name}",
    )


def record_hard_timeout(
    *, task_id: str | None, task_name: str, message: Any, timeout: float, args: Any, kwargs: Any
) -> None:
    """Worker main process: the hard time limit killed a handler past max_run_time."""
    _record(
        task_id=task_id,
        task_name=task_name,
        message=message,
        reason=DeadLetterReason.MAX_RUN_TIME,
        args=list(args or ()),
        kwargs=dict(kwargs or {}),
        error_class="billiard.exceptions.TimeLimitExceeded",
        error_message=f"Task {task_name}: killed by the hard time limit after {timeout:g}s "
        "(max_run_time exceeded, soft limit ignored)",
    )
