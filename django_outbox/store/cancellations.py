"""An operator's cancellation, written as data: the Django side of
``celery_explicit.cancellation``.

``cancel(task_id=... | key=..., by=..., reason=...)`` writes the ``Cancellation`` row,
then the state store's mark the job path looks at. Refused, with nothing written:

- a task id no row of ours names (outbox, attempts, dead letters, ledger): a job that
  left no row yet (published with ``apply_async``, never run) is cancelled by its key;
- a job whose effect already committed: the ledger entry is named, and nothing can
  undo it from here.

The row is written under the job's cancellation locks, taken exclusively (the effect of
a cancellable job takes them shared before it reads the cancellations): a commit in
progress finishes first, and the cancel then finds its ledger entry. The mark comes
after the row's commit; without Redis the row alone refuses the commit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import connections, transaction
from django.utils import timezone

from celery_explicit import cancellation, job_log
from celery_explicit.headers import KEY_HEADER
from django_outbox import times
from django_outbox.conf import settings
from django_outbox.db import ledger_sql
from django_outbox.models import (
    Attempt,
    Cancellation,
    DeadLetter,
    OutboxEvent,
    ProcessedOperation,
)

__all__ = ["AlreadyApplied", "NotCancelled", "UnknownJob", "cancel", "of_jobs"]

logger = job_log.get_logger("django_outbox.store.cancellations")


class NotCancelled(Exception):
    """Nothing was cancelled; the message says why in one line."""


class UnknownJob(NotCancelled):
    pass


class AlreadyApplied(NotCancelled):
    def __init__(self, entry: ProcessedOperation) -> None:
        self.entry = entry
        super().__init__(
            f"cannot cancel: the effect of key {entry.key} committed at "
            f"{times.shown(entry.processed_at)} (task {entry.task_id}, {entry.task_name}"
            + (f", version {entry.app_version}" if entry.app_version else "")
            + "): a cancel stops a job before its effect, it does not undo one"
        )


@dataclass(frozen=True)
class Job:
    """What our rows say of a job named by its task id."""

    task_id: str
    key: str
    task_name: str


def cancel(
    *, task_id: str = "", key: str = "", by: str, reason: str = "", using: str | None = None
) -> tuple[Cancellation, bool]:
    """Cancel the job ``task_id``, or every job of ``key`` whose effect has not
    committed. Returns the row and whether this call wrote it (False: it was cancelled
    already). Raises ``NotCancelled`` (``UnknownJob``, ``AlreadyApplied``)."""
    task_id, key, by = task_id.strip(), key.strip(), by.strip()
    if bool(task_id) == bool(key):
        raise NotCancelled("name one job: its task id, or its key (--key), not both")
    if not by:
        raise NotCancelled("say who cancels (--by): the row keeps it as evidence")
    db = using or settings.database
    job = _known(task_id, db) if task_id else None
    with transaction.atomic(using=db):
        connection = connections[db]
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(ledger_sql.CANCEL_EXCLUSIVE, [task_id, key])
        # Read under the locks: an effect that was committing has committed by now.
        entries = ProcessedOperation.objects.using(db)
        applied = (
            entries.filter(key=key).first()
            if key
            else entries.filter(task_id=task_id).first()
            or (entries.filter(key=job.key).first() if job and job.key else None)
        )
        if applied is not None:
            raise AlreadyApplied(applied)
        rows = Cancellation.objects.using(db)
        existing = rows.filter(task_id=task_id) if task_id else rows.filter(idempotency_key=key)
        first = existing.order_by("requested_at").first()
        if first is not None:
            return first, False
        row = rows.create(
            task_id=task_id,
            idempotency_key=key,
            task_name=job.task_name if job else "",
            requested_by=by[:150],
            requested_at=timezone.now(),
            reason=reason,
        )
    try:
        cancellation.mark(task_id, key, by)
    except Exception as exc:
        logger.warning(
            "cancellation of %s written, its mark not (%s): the job may start, and its "
            "effect's commit is refused",
            task_id or key,
            exc,
        )
    return row, True


def of_jobs(task_ids: set[str], keys: set[str], *, using: str | None = None) -> list[Cancellation]:
    """The cancellations naming any of these task ids or keys (for explain)."""
    db = using or settings.database
    rows = Cancellation.objects.using(db)
    found = list(rows.filter(task_id__in=task_ids - {""})) if task_ids else []
    if keys - {""}:
        found += list(rows.filter(idempotency_key__in=keys - {""}))
    return sorted({r.pk: r for r in found}.values(), key=lambda r: r.requested_at)


def _known(task_id: str, db: str) -> Job:
    """The job ``task_id`` as our rows know it; ``UnknownJob`` when none does."""
    attempt = Attempt.objects.using(db).filter(task_id=task_id).order_by("-started_at").first()
    if attempt is not None:
        return Job(task_id, attempt.idempotency_key, attempt.task_name)
    event = _outbox_event(task_id, db)
    if event is not None:
        headers = event.headers if isinstance(event.headers, dict) else {}
        return Job(task_id, str(headers.get(KEY_HEADER, "")), event.task_name)
    letter = DeadLetter.objects.using(db).filter(task_id=task_id).first()
    if letter is not None:
        return Job(task_id, letter.idempotency_key, letter.task_name)
    entry = ProcessedOperation.objects.using(db).filter(task_id=task_id).first()
    if entry is not None:
        return Job(task_id, entry.key, entry.task_name)
    raise UnknownJob(
        f"no job with task id {task_id}: none in the outbox, the attempts, the dead letters "
        "or the ledger; a job that left no row yet is cancelled by its key (--key)"
    )


def _outbox_event(task_id: str, db: str) -> OutboxEvent | None:
    try:
        event_id = uuid.UUID(task_id)
    except ValueError:
        return None  # not a UUID: no outbox event has it
    return OutboxEvent.objects.using(db).filter(event_id=event_id).first()
