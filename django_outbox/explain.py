"""Explain a job from the stored data alone: what happened to it, in time order, and why.

``manage.py explain <what>`` answers the three questions of a 3 a.m. incident (which
entities, did the effect happen, why was the job repeated) from the rows the job path
left: attempts, the ledger row, fences, dead letters and outbox rows. ``<what>`` is an
idempotency key, a task id, a dead letter id, an outbox event id, or a business id
found as one ``:``-separated part of keys (``1003`` finds ``order:1003:ship``). Each
match is one key: its timeline (millisecond timestamps) and a verdict.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q

from celery_explicit.outcomes import Outcome
from django_outbox import verdict
from django_outbox.conf import settings
from django_outbox.errors import OutboxError
from django_outbox.models import Attempt, DeadLetter, Fence, OutboxEvent, ProcessedOperation
from django_outbox.verdict import stamp

__all__ = ["ExplainError", "Event", "Explanation", "explain", "stamp", "uuid_or_none"]

#: Keys listed for one business id at most; a wider search should be narrowed.
MAX_MATCHES = 20
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]{1,255}$")


class ExplainError(OutboxError):
    """``explain`` was given nothing it can look up (the message says why)."""


@dataclass
class Event:
    at: datetime
    kind: str  # published, attempt, takeover, effect, dead_letter, replay
    text: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Explanation:
    key: str
    task_ids: list[str]
    events: list[Event]
    verdict: str

    def as_data(self) -> dict[str, Any]:
        data = asdict(self)
        for event in data["events"]:
            event["at"] = stamp(event["at"])
        return data


def explain(what: str) -> list[Explanation]:
    """Every job ``what`` names, explained; ``ExplainError`` when there is none."""
    query = what.strip()
    if not _PRINTABLE.match(query):
        raise ExplainError(
            f"cannot explain {what!r}: give an idempotency key, a task id, a dead letter "
            "id, an outbox event id or a business id (printable, at most 255 characters)"
        )
    keys, task_ids = _resolve(query)
    if not keys and not task_ids:
        raise ExplainError(f"nothing recorded for {query!r}: no key, task, dead letter or event")
    found = [_explain_key(key) for key in keys[:MAX_MATCHES]]
    # A task with no key of record (bad input, a pending outbox event) is its own job.
    known = {task_id for explanation in found for task_id in explanation.task_ids}
    found += [_explain_task(task_id) for task_id in task_ids if task_id not in known]
    return found


# --- finding the jobs ----------------------------------------------------------------


def _resolve(query: str) -> tuple[list[str], list[str]]:
    """(idempotency keys, task ids without a key) that ``query`` names."""
    db = settings.database
    attempts = Attempt.objects.using(db)
    letters = DeadLetter.objects.using(db)
    named_letter: list[str] = []
    if query.isdigit() and len(query) <= 18:  # a dead letter id (bigint), or a business id
        letter = letters.filter(pk=int(query)).first()
        if letter is not None and not letter.idempotency_key:
            return [], [letter.task_id]
        if letter is not None:
            named_letter = [letter.idempotency_key]
    exact = _keys_of(Q(idempotency_key=query), Q(key=query))
    if exact:
        return exact, []
    # The ledger's task_id has no index (it would cost every effect an index write):
    # read it only for a task no attempt row names.
    by_task = _keys_of(Q(task_id=query), None)
    if not by_task and not attempts.filter(task_id=query).exists():
        by_task = _keys_of(Q(pk__in=[]), Q(task_id=query))
    # Another message that reused this id has its own letter, ``<id>#<suffix>``
    # (django_outbox.dead_letters): each letter is a job of its own.
    id_letters = list(
        letters.filter(Q(task_id=query) | Q(task_id__startswith=f"{query}#")).values_list(
            "task_id", "idempotency_key"
        )
    )
    by_task += [k for _, k in id_letters if k and k not in by_task]
    if by_task:
        return by_task, []
    # Letters without a key (bad input, unknown tasks) are found by their id alone.
    keyless = sorted(task_id for task_id, k in id_letters if not k)
    if keyless:
        return [], keyless
    if uuid_or_none(query) is not None:
        if OutboxEvent.objects.using(db).filter(event_id=query).exists():
            return [], [query]
        if attempts.filter(task_id=query).exists():
            return [], [query]
    # A business id: one ``:``-separated part of a key. ``icontains`` narrows through
    # the trigram indexes the admin's search uses (migration 0011); the part match
    # decides.
    part = re.compile(rf"(^|:){re.escape(query)}(:|$)")
    candidates = _keys_of(Q(idempotency_key__icontains=query), Q(key__icontains=query))
    business = sorted(k for k in candidates if part.search(k) and k not in named_letter)
    return named_letter + business, []


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


# --- one job -------------------------------------------------------------------------


def _explain_key(key: str) -> Explanation:
    db = settings.database
    attempts = list(Attempt.objects.using(db).filter(idempotency_key=key).order_by("started_at"))
    ledger = ProcessedOperation.objects.using(db).filter(key=key).first()
    task_ids = sorted({a.task_id for a in attempts} | ({ledger.task_id} if ledger else set()))
    letters = list(
        DeadLetter.objects.using(db).filter(Q(idempotency_key=key) | Q(task_id__in=task_ids))
    )
    task_ids = sorted(set(task_ids) | {letter.task_id for letter in letters})
    return _explanation(key, task_ids, attempts, ledger, letters)


def _explain_task(task_id: str) -> Explanation:
    db = settings.database
    attempts = list(Attempt.objects.using(db).filter(task_id=task_id).order_by("started_at"))
    letters = list(DeadLetter.objects.using(db).filter(task_id=task_id))
    return _explanation("", [task_id], attempts, None, letters)


def _explanation(
    key: str,
    task_ids: list[str],
    attempts: list[Attempt],
    ledger: ProcessedOperation | None,
    letters: list[DeadLetter],
) -> Explanation:
    db = settings.database
    # A replay is a new task whose attempts point at the letter (replay_of).
    seen = {a.pk for a in attempts}
    replays = (
        [
            a
            for a in Attempt.objects.using(db)
            .filter(replay_of__in=[letter.pk for letter in letters])
            .order_by("started_at")
            if a.pk not in seen
        ]
        if letters
        else []
    )
    attempts = sorted([*attempts, *replays], key=lambda a: a.started_at)
    all_tasks = sorted(set(task_ids) | {a.task_id for a in attempts})
    fences = list(Fence.objects.using(db).filter(task_id__in=all_tasks))
    events = list(_outbox_events(all_tasks))
    events += [_attempt_event(a, attempts) for a in attempts]
    events += [_fence_event(f) for f in fences]
    if ledger is not None:
        events.append(
            Event(
                ledger.processed_at,
                "effect",
                f"effect applied: ledger row for {ledger.key} by task {ledger.task_id}"
                + (f", result {ledger.result_ref}" if ledger.result_ref else ""),
                {"task_id": ledger.task_id, "result_ref": ledger.result_ref},
            )
        )
    events += [_letter_event(letter, attempts, letters) for letter in letters]
    events.sort(key=lambda event: event.at)
    return Explanation(
        key=key,
        task_ids=all_tasks,
        events=events,
        verdict=verdict.verdict(attempts, ledger, letters, fences),
    )


def _outbox_events(task_ids: list[str]) -> list[Event]:
    ids = [t for t in task_ids if uuid_or_none(t) is not None]
    rows = OutboxEvent.objects.using(settings.database).filter(event_id__in=ids)
    events = []
    for row in rows:
        data = {"event_id": str(row.event_id), "status": row.status, "attempts": row.attempts}
        events.append(
            Event(row.created_at, "outbox", f"written to the outbox (event {row.event_id})", data)
        )
        if row.published_at is not None:
            events.append(
                Event(
                    row.published_at,
                    "published",
                    f"published by the outbox relay after {row.attempts} publish attempt(s)",
                    data,
                )
            )
    return events


def _attempt_event(attempt: Attempt, attempts: list[Attempt]) -> Event:
    outcome = Outcome(attempt.outcome)
    runs_of_same = [a for a in attempts if a.task_id == attempt.task_id]
    same_number = [a for a in runs_of_same if a.attempt == attempt.attempt]
    notes = []
    if attempt.redelivered:
        notes.append("redelivered by the broker")
    if len(same_number) > 1 and same_number[0] is not attempt:
        notes.append("a second execution of the same attempt")
    if attempt.replay_of is not None:
        notes.append(f"replay of dead letter {attempt.replay_of}")
    if runs_of_same and runs_of_same[0] is attempt and attempt.published_via:
        notes.append(f"published {attempt.published_via.replace('_', ' ')}")
    if attempt.deferrals:
        notes.append("deferred before: " + verdict.deferral_text(attempt.deferrals))
    error = f" {attempt.error_class}" if attempt.error_class else ""
    retry = f"; retry in {attempt.retry_delay:.1f}s" if attempt.retry_delay is not None else ""
    text = (
        f"attempt {attempt.attempt} of task {attempt.task_id} on {attempt.worker_host} "
        f"pid {attempt.worker_pid}: {outcome.value}{error} after {attempt.duration_ms:.0f} ms"
        f"{retry}" + (f" ({', '.join(notes)})" if notes else "")
    )
    data = {
        "task_id": attempt.task_id,
        "attempt": attempt.attempt,
        "worker_host": attempt.worker_host,
        "worker_pid": attempt.worker_pid,
        "duration_ms": round(attempt.duration_ms, 3),
        "outcome": outcome.value,
        "error_class": attempt.error_class,
        "retry_delay": attempt.retry_delay,
        "redelivered": attempt.redelivered,
        "replay_of": attempt.replay_of,
        "published_via": attempt.published_via,
        "deferrals": attempt.deferrals or {},
    }
    return Event(attempt.started_at, "attempt", text, data)


def _fence_event(fence: Fence) -> Event:
    return Event(
        fence.taken_over_at,
        "takeover",
        f"execution lease of task {fence.task_id} taken over from {fence.taken_over_from} "
        f"(fencing token {fence.token}): that execution's commit is refused",
        {"task_id": fence.task_id, "token": fence.token, "from": fence.taken_over_from},
    )


def _letter_event(letter: DeadLetter, attempts: list[Attempt], letters: list[DeadLetter]) -> Event:
    led_to = _replay_result(letter, attempts, letters)
    after = (
        f"; replayed as task {letter.replayed_task_id}{led_to}" if letter.replayed_task_id else ""
    )
    return Event(
        letter.last_attempt,
        "dead_letter",
        f"dead letter {letter.pk}: {letter.reason} after {letter.attempts} attempt(s)"
        f" ({letter.error_class or 'no error class'}); status {letter.status}{after}",
        {
            "dead_letter": letter.pk,
            "reason": letter.reason,
            "status": letter.status,
            "replayed_task_id": letter.replayed_task_id,
            "replay_led_to": led_to.removeprefix(", which "),
        },
    )


def _replay_result(letter: DeadLetter, attempts: list[Attempt], letters: list[DeadLetter]) -> str:
    """What a replay led to: its last attempt's outcome, or the letter it became."""
    again = [d for d in letters if d.task_id == letter.replayed_task_id]
    if again:
        return f", which was dead-lettered again ({again[0].reason}, dead letter {again[0].pk})"
    runs = [a for a in attempts if a.task_id == letter.replayed_task_id]
    return f", which ended {runs[-1].outcome}" if runs else ", which has not run yet"
