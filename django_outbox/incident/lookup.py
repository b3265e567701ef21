"""What ``explain`` was asked about: the jobs a key, an id or a business id names.

``<what>`` is an idempotency key, a task id, a dead letter id, an outbox event id, or a
business id found as one ``:``-separated part of keys (``1003`` finds
``order:1003:ship``). ``resolve`` returns each job found with the rule it matched by;
a bare number can match several ways (a dead letter's id and a business id), and each
match says which.
"""

from __future__ import annotations

import re
import uuid

from django.db.models import Q

from django_outbox.conf import settings
from django_outbox.models import Attempt, DeadLetter, OutboxEvent, ProcessedOperation

__all__ = ["MAX_MATCHES", "PRINTABLE", "resolve", "uuid_or_none"]

#: Keys listed for one business id at most; a wider search should be narrowed.
MAX_MATCHES = 20
PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]{1,255}$")


def resolve(query: str) -> tuple[dict[str, str], dict[str, str]]:
    """The idempotency keys and the task ids without a key that ``query`` names, each
    with the rule it matched by. A bare number can match several ways (a dead letter's
    id and a business id): each match says which."""
    db = settings.database
    attempts = Attempt.objects.using(db)
    letters = DeadLetter.objects.using(db)
    by_letter: dict[str, str] = {}
    if query.isdigit() and len(query) <= 18:  # a dead letter id (bigint), or a business id
        letter = letters.filter(pk=int(query)).first()
        if letter is not None and not letter.idempotency_key:
            return {}, {letter.task_id: f"dead letter id {query}"}
        if letter is not None:
            by_letter[letter.idempotency_key] = f"dead letter id {query}"

    def with_letter(keys: list[str], rule: str) -> dict[str, str]:
        found = dict(by_letter)
        for key in keys:
            found[key] = f"{found[key]} and {rule}" if key in found else rule
        return found

    exact = _keys_of(Q(idempotency_key=query), Q(key=query))
    if not exact and letters.filter(idempotency_key=query).exists():
        # Only dead letters hold it: a job no worker ran (the relay's, an unknown task's).
        exact = [query]
    if exact:
        return with_letter(exact, "idempotency key"), {}
    # The ledger's task_id has no index (it would cost every effect an index write):
    # read it only for a task no attempt row names.
    by_task = _keys_of(Q(task_id=query), None)
    if not by_task and not attempts.filter(task_id=query).exists():
        by_task = _keys_of(Q(pk__in=[]), Q(task_id=query))
    # Another message that reused this id has its own letter, ``<id>#<suffix>``
    # (django_outbox.store.dead_letters): each letter is a job of its own.
    id_letters = list(
        letters.filter(Q(task_id=query) | Q(task_id__startswith=f"{query}#")).values_list(
            "task_id", "idempotency_key"
        )
    )
    by_task += [k for _, k in id_letters if k and k not in by_task]
    if by_task:
        return with_letter(by_task, "task id"), {}
    # Letters without a key (bad input, unknown tasks) are found by their id alone.
    keyless = sorted(task_id for task_id, k in id_letters if not k)
    if keyless:
        return by_letter, {task_id: "task id of a dead letter" for task_id in keyless}
    if uuid_or_none(query) is not None:
        if OutboxEvent.objects.using(db).filter(event_id=query).exists():
            return by_letter, {query: "outbox event id"}
        if attempts.filter(task_id=query).exists():
            return by_letter, {query: "task id"}
    # A business id: one ``:``-separated part of a key. ``icontains`` narrows through
    # the trigram indexes the admin's search uses (migration 0011); the part match
    # decides.
    part = re.compile(rf"(^|:){re.escape(query)}(:|$)")
    candidates = _keys_of(Q(idempotency_key__icontains=query), Q(key__icontains=query))
    business = sorted(k for k in candidates if part.search(k))
    return with_letter(business, f"business id {query} in the key"), {}


def _keys_of(attempt_filter: Q, ledger_filter: Q | None) -> list[str]:
    db = settings.database
    keys = set(
        Attempt.objects.using(db)
        .filter(attempt_filter)
        .exclude(idempotency_key="")
        .values_list("idempotency_key", flat=True)
        .distinct()[: MAX_MATCHES * 10]
    )
    if ledger_filter is not None:
        keys.update(
            ProcessedOperation.objects.using(db)
            .filter(ledger_filter)
            .values_list("key", flat=True)[: MAX_MATCHES * 10]
        )
    return sorted(keys)


def uuid_or_none(value: str) -> uuid.UUID | None:
    """``value`` as a UUID (an outbox event id, a task id), None if it is not one."""
    try:
        return uuid.UUID(value)
    except ValueError:
        return None
