"""What replay and discard will do to each dead letter, for their confirmation page,
and the arguments the admin may show (a task's sensitive fields redacted)."""

from __future__ import annotations

from typing import Any

from celery_explicit import sensitive
from django_outbox.conf import settings
from django_outbox.incident.explain import stamp, uuid_or_none
from django_outbox.models import (
    DeadLetter,
    DeadLetterReason,
    DeadLetterStatus,
    OutboxEvent,
    ProcessedOperation,
)
from django_outbox.store import dead_letters


def plan(letter: DeadLetter, action: str) -> dict[str, Any]:
    """One row of the confirmation page: what will happen to ``letter``, or why not."""
    row: dict[str, Any] = {"letter": letter, "refusal": "", "will": "", "applied": None}
    if action == "discard":
        if letter.status != DeadLetterStatus.OPEN:
            row["refusal"] = f"it is {letter.status}, not open: it will not be discarded"
        else:
            row["will"] = "closed as discarded; the row stays as evidence"
        return row
    row["refusal"] = dead_letters.replay_refusal(letter)
    if letter.reason == DeadLetterReason.CONFLICT and letter.idempotency_key:
        # The conflict beside the new arguments: what the ledger holds for the key
        # (its fingerprint, and the arguments where an outbox row kept them).
        applied = ProcessedOperation.objects.filter(key=letter.idempotency_key).first()
        if applied is not None:
            event_id = uuid_or_none(applied.task_id)
            source = OutboxEvent.objects.filter(event_id=event_id).first() if event_id else None
            row["applied"] = {
                "row": applied,
                "at": stamp(applied.processed_at),
                "arguments": (
                    "args={!r} kwargs={!r}".format(*shown_arguments(source))
                    if source is not None
                    else "not stored (only their fingerprint is)"
                ),
            }
    if not row["refusal"]:
        row["will"] = (
            f"published again to {dead_letters.replay_destination(letter)} with key "
            f"{letter.idempotency_key!r} and a new task id; its attempts link back here"
        )
    return row


def shown_arguments(event: OutboxEvent) -> tuple[list[Any], dict[str, Any]]:
    """An outbox row's arguments as the admin may show them: a task's declared
    sensitive fields redacted (``celery_explicit.sensitive``)."""
    signature, fields = sensitive.of_task(event.task_name, settings.celery_app())
    if not fields:
        return list(event.args), dict(event.kwargs)
    return sensitive.redact(fields, signature, event.args, event.kwargs)
