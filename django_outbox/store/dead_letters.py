"""Dead letters: messages that will not run again by themselves, kept as evidence.

A message lands here on a permanent or unclassified error, when its attempts are
exhausted, on an idempotency conflict, or as bad input (arguments that do not fit,
a body that does not decode, an unknown task name). It is never retried by itself;
an operator replays it (same idempotency key, linked to this row) or discards it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from celery_explicit import app_version, sensitive
from celery_explicit.headers import KEY_HEADER, REPLAY_HEADER, SENT_AT_HEADER
from django_outbox.conf import settings
from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, DeadLetterStatus


def record(
    *,
    task_id: Any,
    task_name: str,
    reason: DeadLetterReason,
    args: Any = (),
    kwargs: Any = None,
    raw_body: str = "",
    idempotency_key: str = "",
    error_class: str = "",
    error_message: str = "",
    traceback: str = "",
    attempts: int = 1,
    correlation_id: str = "",
    queue: str = "",
    exchange: str = "",
) -> DeadLetter:
    """Insert or update the dead letter of ``task_id``.

    A message redelivered after a crash may fail again: it updates its row (attempts,
    last attempt, error) instead of adding a second one. ``first_seen`` is when the
    job's first recorded attempt started (retries keep the task id), else now.

    ``task_id`` is whatever the message carried (``id_text``): a malformed message
    reaches here from the worker's main process and, through protocol 1, from the task.

    A task's sensitive fields are redacted here (``celery_explicit.sensitive``).
    """
    task_id = id_text(task_id)
    # Every dead letter comes through here, whoever writes it: a task's sensitive
    # fields are kept redacted and their values scrubbed from the raw body, the error
    # and the traceback, whether the writer knew the task's contract or not.
    shown = sensitive.for_task(str(task_name), settings.celery_app(), args, kwargs)
    if shown.fields:
        args, kwargs = shown.arguments(
            args if isinstance(args, list | tuple) else (),
            kwargs if isinstance(kwargs, dict) else {},
        )
        raw_body, error_message, traceback = (
            shown.text(raw_body),
            shown.text(error_message),
            shown.text(traceback),
        )
    now = timezone.now()
    first_seen = (
        Attempt.objects.using(settings.database)
        .filter(task_id=task_id)
        .aggregate(first=Min("started_at"))["first"]
        if task_id
        else None
    ) or now
    defaults: dict[str, Any] = dict(
        task_name=text(task_name)[:255],
        reason=reason,
        raw_body=text(raw_body),
        args=_jsonable(list(args) if isinstance(args, list | tuple) else args),
        kwargs=_jsonable(kwargs if kwargs is not None else {}),
        idempotency_key=text(idempotency_key)[:255],
        error_class=text(error_class)[:255],
        error_message=text(error_message),
        traceback=text(traceback),
        attempts=attempts,
        last_attempt=now,
        correlation_id=text(correlation_id)[:255],
        queue=text(queue)[:255],
        exchange=text(exchange)[:255],
        app_version=app_version.current(),
    )
    letters = DeadLetter.objects.using(settings.database)
    name = text(task_id or f"unidentified-{uuid.uuid4()}")[:255]
    create = {**defaults, "first_seen": first_seen, "status": DeadLetterStatus.OPEN}
    with transaction.atomic(using=settings.database):
        letter, created = letters.select_for_update().get_or_create(task_id=name, defaults=create)
        if created:
            return letter
        if not _same_message(letter, defaults):
            # Another message carrying the same id (a producer reusing ids, an id of a
            # malformed message): it gets its own letter, named after the id, and the
            # letter already there stays as it was; updating it would lose one of them.
            return letters.create(task_id=f"{name[:230]}#{uuid.uuid4().hex[:12]}", **create)
        # The same message redelivered and failing again updates its letter but does
        # not reopen one an operator already replayed or discarded (that would allow a
        # second replay).
        for field, value in defaults.items():
            setattr(letter, field, value)
        letter.save(update_fields=list(defaults))
        return letter


def _same_message(letter: DeadLetter, new: dict[str, Any]) -> bool:
    """Whether ``new`` is the message ``letter`` already holds: its task, arguments
    and raw body (as stored: JSON's lists for tuples)."""

    def stored(value: Any) -> Any:
        return json.loads(json.dumps(value, default=str))

    return bool(
        letter.task_name == new["task_name"]
        and letter.raw_body == new["raw_body"]
        and stored(letter.args) == stored(new["args"])
        and stored(letter.kwargs) == stored(new["kwargs"])
    )


def replay(letter: DeadLetter, *, by: str) -> str:
    """Publish the dead letter's task again, with the same idempotency key.

    Returns the new task id. The message carries the dead letter's id so the attempts
    it causes link back to it. Refuses a letter that is not open.
    """
    app = settings.celery_app()
    new_id = str(uuid.uuid4())
    with transaction.atomic(using=settings.database):
        locked = DeadLetter.objects.using(settings.database).select_for_update().get(pk=letter.pk)
        refusal = replay_refusal(locked)
        if refusal:
            raise ValueError(refusal)
        locked.status = DeadLetterStatus.REPLAYED
        locked.replayed_task_id = new_id
        locked.resolved_at = timezone.now()
        locked.resolved_by = by[:150]
        locked.save(update_fields=["status", "replayed_task_id", "resolved_at", "resolved_by"])
        headers: dict[str, object] = {REPLAY_HEADER: letter.pk, SENT_AT_HEADER: time.time()}
        if letter.idempotency_key:
            headers[KEY_HEADER] = letter.idempotency_key
        # Published before the status change commits: a publish that fails leaves the
        # letter open (and replayable); a commit that fails after a publish leaves a
        # duplicate message, which the ledger absorbs.
        # Back to where it came from: the exchange and routing key it was delivered
        # with (a routing key is a queue's name only on the default routes). Letters
        # recorded before the exchange was kept go to the queue named like the key.
        where: dict[str, Any] = (
            {"exchange": letter.exchange, "routing_key": letter.queue}
            if letter.exchange
            else {"queue": letter.queue or None}
        )
        app.send_task(
            letter.task_name,
            args=letter.args,
            kwargs=letter.kwargs,
            task_id=new_id,
            headers=headers,
            **where,
        )
    letter.refresh_from_db()
    return new_id


def replay_refusal(letter: DeadLetter) -> str:
    """Why ``letter`` cannot be replayed, or ``""`` when it can.

    The confirmation page shows this before anything is done; ``replay`` checks it again
    under the row lock, so a letter closed in between is still refused.
    """
    if letter.status != DeadLetterStatus.OPEN:
        return (
            f"dead letter {letter.pk} ({letter.task_name}) is {letter.status}, "
            "not open: not replayed"
        )
    redacted = sensitive.holds_redacted(letter.args, letter.kwargs)
    if redacted:
        return (
            f"dead letter {letter.pk} ({letter.task_name}) was kept with its sensitive "
            f"arguments redacted ({', '.join(redacted)}): a replay would run with "
            "'[redacted]' in their place, so it is not replayed. Publish the job again "
            "from its source"
        )
    if letter.reason == DeadLetterReason.CONFLICT:
        # Its key's effect was applied with other arguments: the replay would meet
        # the same ledger entry and fail the same way.
        return (
            f"dead letter {letter.pk} ({letter.task_name}) is a conflict: key "
            f"{letter.idempotency_key!r} was already applied with other arguments "
            f"(these: args={letter.args!r} kwargs={letter.kwargs!r}), so a replay can "
            "only fail again: not replayed. Discard it, or publish the change as a "
            "new operation with its own key"
        )
    return ""


def replay_destination(letter: DeadLetter) -> str:
    """Where a replay publishes, in words (the confirmation page says it)."""
    if letter.exchange:
        return f"exchange {letter.exchange!r}, routing key {letter.queue!r}"
    return f"queue {letter.queue!r}" if letter.queue else "the task's default queue"


def discard(letter: DeadLetter, *, by: str) -> None:
    """Close the dead letter without running it. The row stays as evidence."""
    updated = (
        DeadLetter.objects.using(settings.database)
        .filter(pk=letter.pk, status=DeadLetterStatus.OPEN)
        .update(status=DeadLetterStatus.DISCARDED, resolved_at=timezone.now(), resolved_by=by[:150])
    )
    if not updated:
        raise ValueError(f"dead letter {letter.pk} ({letter.task_name}) is not open: not discarded")
    letter.refresh_from_db()


def id_text(task_id: Any) -> str | None:
    """A message's id as a dead letter's ``task_id``: a str, or an integer's text.

    A message's id may be any JSON value. Anything else (a dict, a list, a bool) names
    no message: as its text, every message with the id ``{}`` would update one dead
    letter (``record`` keeps one per id), and all but the last would vanish. None gives
    each its own letter (``unidentified-...``); the raw body is kept.
    """
    if isinstance(task_id, str):
        return task_id
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        return str(task_id)
    return None


def text(value: Any) -> str:
    """PostgreSQL text cannot hold NUL: keep it visible as ``\\x00`` instead of failing
    to record the evidence at all. A value that is not text (a malformed message's
    field) is kept as its text, never dropped."""
    string = value if isinstance(value, str) else str(value)
    return string.replace("\x00", "\\x00")


def _jsonable(value: Any) -> Any:
    """Arguments as JSON can store them; anything else as its repr, never dropped.

    PostgreSQL jsonb refuses ``\\u0000``: such arguments are kept as their repr.
    """
    try:
        dumped = json.dumps(value)
    except (TypeError, ValueError):
        return text(repr(value))
    if "\\u0000" in dumped:
        return text(repr(value))
    return value
