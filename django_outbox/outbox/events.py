"""The transactional outbox: a job or event written in the business transaction.

A row in ``django_outbox_event`` commits or rolls back with the business change that
caused it, so a rollback publishes nothing and a broker that is down at commit loses
nothing: the row waits until ``manage.py explicit_relay`` (``django_outbox.outbox.relay.loop``)
publishes it, with the row's ``event_id`` as the Celery task id.

Usage, inside the business transaction::

    with transaction.atomic():
        order.status = "paid"
        order.save()
        publish_event("shop.send_receipt", {"order_id": order.id}, ordering_key=f"order:{order.id}")

A *topic* is the name of a registered Celery task, and a domain event's payload is that
task's keyword arguments: the consumer is an ordinary task, with its own idempotency
key, which absorbs the duplicate an at-least-once relay may send. (``dispatch(task,
..., durable=True)`` writes the same row from a task object and its arguments.)

Refused at the call, inside the transaction, so the business change fails with it:

- writing outside a transaction: the event would commit on its own, apart from the
  change it announces (wrap both in ``transaction.atomic(using=...)``);
- a payload that is not plain JSON (a datetime, a Decimal, a UUID, a set, NUL in a
  string): stored rows are read back by another process, and by operators in the
  admin, so nothing is converted behind the caller's back; pass ``str(value)``;
- when the topic's task is registered in this process: arguments that do not fit its
  ``run()``, or an ExplicitTask's idempotency key that cannot be rendered. A topic no
  task here knows is accepted; the relay dead-letters it if it knows none either.

Events sharing an ``ordering_key`` are published in the order they were written. On
PostgreSQL the writer takes a transaction-scoped advisory lock on the key first, so
two transactions writing the same key commit in the order their rows were numbered:
the relay's "oldest first" is then also "first committed first". They serialise on
that key until commit (never across keys).
"""

from __future__ import annotations

import inspect
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task
from django.db import connections
from django.db.transaction import TransactionManagementError

from celery_explicit import correlation, job_log, keys, tracing
from celery_explicit.errors import BadInput, qualname
from celery_explicit.headers import CORRELATION_HEADER, KEY_HEADER
from django_outbox.conf import settings
from django_outbox.db import outbox_sql
from django_outbox.models import OutboxEvent, OutboxStatus
from django_outbox.outbox import prepared

logger = job_log.get_logger("django_outbox.outbox.events")

#: Publish options an outbox row may carry. Anything relative to the moment of the
#: call (countdown, eta, expires) would be measured from the relay's publish instead,
#: and a connection or producer cannot be stored: refused rather than reinterpreted.
STORED_OPTIONS = frozenset({"queue", "routing_key", "exchange", "priority"})


def publish_event(
    topic: str,
    payload: Mapping[str, Any],
    *,
    ordering_key: str = "",
    headers: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    using: str | None = None,
) -> str:
    """Write a domain event in the current transaction; returns its event id.

    ``topic`` names the task that consumes it; ``payload`` becomes its keyword
    arguments. See the module docstring for what is refused.
    """
    kwargs = dict(payload)
    key = ""
    task = _registered_task(topic)
    if task is not None:
        key = check_call(task, (), kwargs)
    return write(
        task_name=topic,
        args=(),
        kwargs=kwargs,
        idempotency_key=key,
        headers=headers,
        options=options,
        ordering_key=ordering_key,
        using=using,
    )


def write(
    *,
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    idempotency_key: str = "",
    headers: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    ordering_key: str = "",
    using: str | None = None,
) -> str:
    """Insert one outbox row in the caller's transaction; returns its event id.

    The arguments were checked against the task by the caller (``check_call``); here
    only what every row needs: a transaction, plain JSON, known options.
    """
    alias = using or settings.database
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"outbox event {task_name} written outside a transaction on database "
            f"{alias!r}: it would commit on its own, apart from the change it announces; "
            f"wrap both in transaction.atomic(using={alias!r})"
        )
    stored_options = dict(options or {})
    unknown = sorted(set(stored_options) - STORED_OPTIONS)
    if unknown:
        raise ValueError(
            f"outbox event {task_name}: publish options {unknown} cannot be stored; an "
            f"outbox row keeps only {sorted(STORED_OPTIONS)}"
        )
    for name, value in stored_options.items():
        wanted = int if name == "priority" else str
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise ValueError(
                f"outbox event {task_name}: publish option {name}={value!r} must be "
                f"a {wanted.__name__}"
            )
    if len(ordering_key) > 255:
        raise ValueError(
            f"outbox event {task_name}: ordering_key is {len(ordering_key)} characters, "
            "longer than 255"
        )
    all_headers = dict(headers or {})
    if idempotency_key:
        all_headers[KEY_HEADER] = idempotency_key
    correlation = _correlation()
    if correlation:
        all_headers.setdefault(CORRELATION_HEADER, correlation)
    stored_args = list(args)
    stored_kwargs = dict(kwargs)
    for field, value in (
        ("args", stored_args),
        ("kwargs", stored_kwargs),
        ("headers", all_headers),
        ("options", stored_options),
    ):
        check_json(task_name, field, value)

    event_id = uuid.uuid4()
    # The trace context goes into the stored headers: the relay continues it later.
    with tracing.outbox_write(task_name, str(event_id), idempotency_key, all_headers):
        message = _prepared(
            task_name,
            str(event_id),
            stored_args,
            stored_kwargs,
            all_headers,
            stored_options,
            idempotency_key,
        )
        if connection.vendor == "postgresql":
            _insert_postgresql(
                connection,
                event_id=event_id,
                task_name=task_name,
                json_fields=[stored_args, stored_kwargs, all_headers, stored_options],
                ordering_key=ordering_key,
                message=message,
            )
        else:
            OutboxEvent.objects.using(alias).create(
                event_id=event_id,
                task_name=task_name,
                args=stored_args,
                kwargs=stored_kwargs,
                headers=all_headers,
                options=stored_options,
                ordering_key=ordering_key,
                message=message.message if message else "",
                message_format=message.format if message else "",
            )
    return str(event_id)


def _prepared(
    task_name: str,
    event_id: str,
    args: list[Any],
    kwargs: dict[str, Any],
    headers: dict[str, Any],
    options: dict[str, Any],
    key: str,
) -> prepared.Prepared | None:
    """The event's prepared message (``EXPLICIT_OUTBOX_PREPARED_MESSAGES``), or None: the
    relay builds it from the row, as it does without the setting."""
    if not settings.outbox_prepared_messages:
        return None
    task = _registered_task(task_name)
    if task is None:
        return None
    try:
        return prepared.prepare(task, event_id, tuple(args), kwargs, headers, options, key=key)
    except Exception as exc:
        # The row is written either way, and its columns are the event: a message that
        # fails to build here is the relay's to build, or to refuse with the event's
        # dead letter, as without the setting.
        logger.warning(
            "outbox event %s (%s): no prepared message stored, the relay builds it: %s: %s",
            event_id,
            task_name,
            qualname(exc),
            exc,
            extra={"task": task_name, "job_id": event_id, "layer": "delivery"},
        )
        return None


def _insert_postgresql(
    connection: Any,
    *,
    event_id: uuid.UUID,
    task_name: str,
    json_fields: list[Any],
    ordering_key: str,
    message: prepared.Prepared | None,
) -> None:
    """The row, its NOTIFY and (with a key) its lock: one statement, or two with a key.

    The write sits in the caller's business transaction, so it is kept to as few
    round trips as the ledger's claim: the ORM's insert plus a NOTIFY would be two.
    """
    channel = settings.outbox_notify_channel
    with connection.cursor() as cursor:
        if ordering_key:
            # Before the insert: the lock must be held when the row takes its number.
            cursor.execute(
                outbox_sql.ORDERING_LOCK, [outbox_sql.ORDERING_LOCK_FAMILY, ordering_key]
            )
        params: list[Any] = [
            event_id,
            task_name,
            *[json.dumps(value) for value in json_fields],
            ordering_key,
            OutboxStatus.PENDING.value,
            message.message if message else "",
            message.format if message else "",
        ]
        if channel:
            cursor.execute(
                outbox_sql.INSERT_EVENT + outbox_sql.NOTIFY_RETURNING, [*params, channel]
            )
        else:
            cursor.execute(outbox_sql.INSERT_EVENT, params)


def check_call(task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:  # type: ignore[type-arg]
    """Raise ``BadInput`` if the arguments do not fit the task; return its key, if any.

    An ExplicitTask binds them to ``run()`` and renders its idempotency key, exactly as
    its ``apply_async`` will; a plain task checks its ``run()`` signature unless it
    was declared with ``typing=False``.
    """
    from celery_explicit.task import ExplicitTask

    if isinstance(task, ExplicitTask):
        _arguments, given = task.bind_arguments(tuple(args), dict(kwargs))
        return keys.render_key(task.name, task.contract.idempotency_key, given)
    if getattr(task, "typing", True):
        try:
            inspect.signature(task.run).bind(*args, **kwargs)
        except TypeError as exc:
            raise BadInput(task.name, f"arguments do not fit run(): {exc}") from None
    return ""


def check_json(topic: str, field: str, value: Any) -> None:
    """Raise ``BadInput`` naming the first value that is not plain JSON, e.g.
    ``kwargs['order']['paid_at'] is a datetime``."""
    problem = _not_json(value, field)
    if problem is not None:
        path, reason = problem
        raise BadInput(
            topic,
            f"outbox payload {path} {reason}: the outbox stores plain JSON (str, int, "
            "float, bool, None, lists, dicts with str keys); convert it before writing, "
            "e.g. str(value) or value.isoformat()",
        )


def _not_json(value: Any, path: str) -> tuple[str, str] | None:
    if value is None or isinstance(value, bool | int):
        return None
    if isinstance(value, str):
        # PostgreSQL's jsonb cannot hold NUL; say so here rather than fail at insert.
        return (path, "contains a NUL character") if "\x00" in value else None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"is {value!r}, not a JSON number")
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            problem = _not_json(item, f"{path}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                return (f"{path}[{name!r}]", f"has a {type(name).__name__} key, not a str")
            problem = _not_json(item, f"{path}[{name!r}]")
            if problem is not None:
                return problem
        return None
    return (path, f"is a {type(value).__module__}.{type(value).__qualname__}")


def _registered_task(name: str) -> Task | None:  # type: ignore[type-arg]
    task: Task | None = settings.celery_app().tasks.get(name)  # type: ignore[type-arg]
    return task


def _correlation() -> str:
    """The caller's correlation id (a web request's, the running job's), else a new one:
    the outbox row is this job's first publish."""
    return correlation.for_publish()
