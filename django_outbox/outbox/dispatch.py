"""Dispatch a task after the transaction commits, never before and never for a rollback.

``task.delay()`` inside ``transaction.atomic()`` publishes at once: the worker may run
before the commit (and not find the row), or run for a transaction that then rolls
back. ``dispatch()`` publishes from ``transaction.on_commit`` instead::

    with transaction.atomic():
        order = Order.objects.create(...)
        dispatch(SendReceipt(), kwargs={"order_id": order.id})        # after commit
        dispatch(CapturePayment(), kwargs={"payment_id": p.id}, durable=True)  # outbox

The arguments are checked at the call, inside the transaction (``BadInput``: they do
not fit ``run()``, the idempotency key cannot be rendered, they cannot be encoded), so
the business transaction fails with them instead of a callback failing after commit.

After commit the publish can still fail (the broker is down). The transaction has
committed and the caller must not be told otherwise, so the error is not raised: it
is logged at ERROR with the task, the task id and the idempotency key, and counted in
``explicit_dispatch_publish_failed_total``. That job is then lost. For jobs that must
not be lost, ``durable=True`` writes an outbox row in the transaction instead
(``django_outbox.outbox.events``) and the relay publishes it: that publish cannot be lost.

Outside a transaction (autocommit) there is nothing to wait for: a plain dispatch
publishes at once and a failure raises to the caller; a durable one is refused
(``django_outbox.outbox.events.write``).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task
from django.db import connections, transaction
from kombu.exceptions import EncodeError
from kombu.serialization import dumps
from prometheus_client import Counter

from celery_explicit import correlation, job_log
from celery_explicit.errors import BadInput, qualname
from celery_explicit.headers import CORRELATION_HEADER, PUBLISHED_VIA_HEADER
from django_outbox.conf import settings
from django_outbox.outbox import events

logger = job_log.get_logger("django_outbox.outbox.dispatch")

published = Counter(
    "explicit_dispatch_published_total",
    "Tasks published by dispatch() (delivery layer), by when: after_commit, or "
    "immediate (no transaction was open).",
    ["task", "when"],
)
publish_failed = Counter(
    "explicit_dispatch_publish_failed_total",
    "Tasks dispatch() could not publish after their transaction committed (delivery "
    "layer): each one is a lost job. durable=True would have kept it in the events.",
    ["task", "error_class"],
)
dispatch_durable = Counter(
    "explicit_dispatch_durable_total",
    "Tasks dispatch(durable=True) wrote to the outbox (delivery layer).",
    ["task"],
)


def dispatch(
    task: Task[Any, Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    durable: bool = False,
    ordering_key: str = "",
    options: Mapping[str, Any] | None = None,
    using: str | None = None,
) -> str:
    """Publish ``task(*args, **kwargs)`` after the transaction on ``using`` commits.

    Returns the task id, chosen now. ``options`` are ``apply_async`` options (``queue``,
    ``countdown``, ...); with ``durable=True`` only those an outbox row can keep
    (``outbox.STORED_OPTIONS``). ``ordering_key`` (durable only): events with the same
    key are published in the order they were written. ``using`` is the database
    alias whose transaction matters (default ``EXPLICIT_DATABASE``).
    """
    call_args = tuple(args)
    call_kwargs = dict(kwargs or {})
    publish_options = dict(options or {})
    if "task_id" in publish_options:
        raise ValueError(
            f"dispatch({task.name}): the task id is chosen by dispatch() and returned; "
            "do not pass it in options"
        )
    if ordering_key and not durable:
        raise ValueError(
            f"dispatch({task.name}): ordering_key needs durable=True (the outbox relay "
            "keeps the order; two on_commit publishes have none)"
        )
    key = events.check_call(task, call_args, call_kwargs)

    if durable:
        event_id = events.write(
            task_name=task.name,
            args=call_args,
            kwargs=call_kwargs,
            idempotency_key=key,
            options=publish_options,
            ordering_key=ordering_key,
            using=using,
        )
        dispatch_durable.labels(task.name).inc()
        return event_id

    _check_encodable(task, call_args, call_kwargs)
    # Taken now, in the caller's context: the callback runs at commit, where the
    # request that caused it may no longer be current.
    headers = dict(publish_options.get("headers") or {})
    headers.setdefault(CORRELATION_HEADER, correlation.for_publish())
    publish_options["headers"] = headers
    task_id = str(uuid.uuid4())
    alias = using or settings.database
    if not connections[alias].in_atomic_block:
        task.apply_async(call_args, call_kwargs, task_id=task_id, **publish_options)
        published.labels(task.name, "immediate").inc()
        return task_id

    def publish_after_commit() -> None:
        try:
            task.apply_async(
                call_args, call_kwargs, task_id=task_id, **_after_commit(publish_options)
            )
        except Exception as exc:
            # Raising here would reach the caller after its commit (a success reported
            # as a failure) and stop Django's later on_commit callbacks; the job is lost
            # either way, so it is made loud instead.
            error_class = qualname(exc)
            publish_failed.labels(task.name, error_class).inc()
            logger.exception(
                "job %s of task %s (idempotency key %r) was not published after its "
                "transaction committed: the job is lost (use durable=True for jobs "
                "that must not be)",
                task_id,
                task.name,
                key,
                extra={
                    "task": task.name,
                    "job_id": task_id,
                    "idempotency_key": key,
                    "layer": "delivery",
                    "error_class": error_class,
                },
            )
            return
        published.labels(task.name, "after_commit").inc()

    transaction.on_commit(publish_after_commit, using=alias)
    return task_id


def _after_commit(options: dict[str, Any]) -> dict[str, Any]:
    """The publish options of an on_commit dispatch, the path named in the headers."""
    headers = {PUBLISHED_VIA_HEADER: "on_commit", **(options.get("headers") or {})}
    return {**options, "headers": headers}


def _check_encodable(task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Encode the body as the publish will, so an argument the serializer refuses fails
    now, inside the transaction, rather than in the callback after commit."""
    serializer = task.serializer or task.app.conf.task_serializer
    try:
        dumps((args, kwargs, {}), serializer=serializer)
    except EncodeError as exc:
        raise BadInput(
            task.name, f"arguments cannot be encoded with the {serializer} serializer: {exc}"
        ) from None
