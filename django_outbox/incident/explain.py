"""Explain a job from the stored data alone: what happened to it, in time order, and why.

``manage.py explicit_explain <what>`` answers the three questions of a 3 a.m. incident (which
entities, did the effect happen, why was the job repeated) from the rows the job path
left: attempts, the ledger row, fences, dead letters and outbox rows. ``<what>`` is an
idempotency key, a task id, a dead letter id, an outbox event id, or a business id
found as one ``:``-separated part of keys (``1003`` finds ``order:1003:ship``). Each
match is one key, with the rule it matched by: its timeline and a verdict.

Every execution is on the timeline: each attempt row, and an execution that left none
(a process killed mid-job) from the fence row of the takeover that followed it (its
host, pid, start and why it lost its lease). The time since the previous event is on
each line, so the wait in the queue, a deferral or a retry's delay reads as a span.
"""

from __future__ import annotations

import itertools
import re
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q

from celery_explicit.outcomes import Outcome
from django_outbox import times
from django_outbox.conf import settings
from django_outbox.errors import OutboxError
from django_outbox.incident import verdict
from django_outbox.incident.verdict import stamp
from django_outbox.models import Attempt, DeadLetter, Fence, OutboxEvent, ProcessedOperation

__all__ = ["ExplainError", "Event", "Explanation", "explain", "stamp", "uuid_or_none"]

#: Keys listed for one business id at most; a wider search should be narrowed.
MAX_MATCHES = 20
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]{1,255}$")

#: Why an execution lost its lease, as a timeline line says it.
_LOST_LEASE = {
    "holder_dead": "its process had died",
    "lease_expired": "its lease had run out (it stopped extending it: stopped, "
    "partitioned, or killed on another host)",
    "": "its cause was not recorded",
}


class ExplainError(OutboxError):
    """``explain`` was given nothing it can look up (the message says why)."""


@dataclass
class Event:
    at: datetime
    kind: str  # outbox, published, attempt, execution, takeover, effect, dead_letter
    text: str
    data: dict[str, Any] = field(default_factory=dict)
    #: Seconds since the previous event of the job (None for the first): a wait in the
    #: queue, a deferral or a retry's delay reads as a span.
    since: float | None = None


@dataclass
class Explanation:
    key: str
    task_ids: list[str]
    events: list[Event]
    verdict: str
    #: How ``what`` found this job: "idempotency key", "task id", "dead letter id 2",
    #: "outbox event id", "business id 1003 in the key".
    matched_by: str = ""

    def as_data(self) -> dict[str, Any]:
        data = asdict(self)
        for event in data["events"]:
            event["at"] = times.iso(event["at"])
            event["data"] = {
                name: times.iso(value) if isinstance(value, datetime) else value
                for name, value in event["data"].items()
            }
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
    found = []
    for key in list(keys)[:MAX_MATCHES]:
        found.append(_explain_key(key))
        found[-1].matched_by = keys[key]
    # A task with no key of record (bad input, a pending outbox event) is its own job.
    known = {task_id for explanation in found for task_id in explanation.task_ids}
    for task_id, rule in task_ids.items():
        if task_id not in known:
            found.append(_explain_task(task_id))
            found[-1].matched_by = rule
    return found


# --- finding the jobs ----------------------------------------------------------------


def _resolve(query: str) -> tuple[dict[str, str], dict[str, str]]:
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
    outboxed = {e.data["event_id"] for e in events}
    events += _publish_events(attempts, outboxed)
    events += [_attempt_event(a, attempts, fences) for a in attempts]
    events += [_unrecorded_event(f, attempts) for f in verdict.unrecorded(fences, attempts)]
    events += [_fence_event(f, attempts) for f in fences]
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
    events += [_closed_event(letter) for letter in letters if letter.resolved_at is not None]
    events.sort(key=lambda event: event.at)
    for before, event in itertools.pairwise(events):
        event.since = (event.at - before.at).total_seconds()
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


def _publish_events(attempts: list[Attempt], outboxed: set[str]) -> list[Event]:
    """When each task's message was first published (the ``sent_at`` its first attempt
    carries): the start of its wait in the queue. The outbox says it for its own."""
    events = []
    for task_id in dict.fromkeys(a.task_id for a in attempts):
        sent = [a.sent_at for a in attempts if a.task_id == task_id and a.sent_at is not None]
        if not sent or task_id in outboxed:
            continue
        first = next(a for a in attempts if a.task_id == task_id)
        via = f" ({first.published_via.replace('_', ' ')})" if first.published_via else ""
        events.append(
            Event(
                min(sent),
                "published",
                f"task {task_id} published{via}",
                {"task_id": task_id, "published_via": first.published_via},
            )
        )
    return events


def _attempt_event(attempt: Attempt, attempts: list[Attempt], fences: list[Fence]) -> Event:
    outcome = Outcome(attempt.outcome)
    runs_of_same = [a for a in attempts if a.task_id == attempt.task_id]
    same_number = [a for a in runs_of_same if a.attempt == attempt.attempt]
    notes = []
    if attempt.sent_at is not None:
        waited = (attempt.started_at - attempt.sent_at).total_seconds()
        notes.append(f"started {waited:.3f} s after its message was published")
    if attempt.redelivered:
        notes.append("redelivered by the broker")
    if attempt in verdict.republished(attempts):
        notes.append("published again with the same task id")
    elif len(same_number) > 1 and same_number[0] is not attempt and not attempt.redelivered:
        notes.append("another delivery of the same task id and attempt number")
    if attempt.replay_of is not None:
        notes.append(f"replay of dead letter {attempt.replay_of}")
    if runs_of_same and runs_of_same[0] is attempt and attempt.published_via:
        notes.append(f"published {attempt.published_via.replace('_', ' ')}")
    if attempt.deferrals:
        notes.append("deferred before: " + verdict.deferral_text(attempt.deferrals))
    for fence in fences:
        if verdict.holder_attempt(fence, [attempt]) is attempt:
            notes.append(
                f"its lease was taken over at {stamp(fence.taken_over_at)}: "
                + _LOST_LEASE.get(fence.cause, fence.cause)
            )
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
        "sent_at": attempt.sent_at,
    }
    return Event(attempt.started_at, "attempt", text, data)


def _unrecorded_event(fence: Fence, attempts: list[Attempt]) -> Event:
    """An execution that left no attempt row, from the takeover that followed it."""
    host, _, pid = fence.taken_over_from.rpartition(":")
    ended = "died" if fence.cause == "holder_dead" else "never ended"
    started = fence.holder_started_at
    ran = (
        f" {(fence.taken_over_at - started).total_seconds():.3f} s before it was taken over"
        if started is not None
        else ""
    )
    text = (
        f"execution of task {fence.task_id} on {verdict.holder_name(fence, attempts)} took "
        f"its lease{ran}; it {ended} without an attempt row "
        f"({_LOST_LEASE.get(fence.cause, fence.cause)})"
    )
    data = {
        "task_id": fence.task_id,
        "worker_host": host,
        "worker_pid": int(pid) if pid.isdigit() else None,
        "started_at": started,
        "ended": ended.replace(" ", "_"),
        "cause": fence.cause,
    }
    return Event(started or fence.taken_over_at, "execution", text, data)


def _fence_event(fence: Fence, attempts: list[Attempt]) -> Event:
    return Event(
        fence.taken_over_at,
        "takeover",
        f"execution lease of task {fence.task_id} taken over from "
        f"{verdict.holder_name(fence, attempts)} {verdict.CAUSES.get(fence.cause, fence.cause)} "
        f"(fencing token {fence.token}): that execution's commit is refused",
        {
            "task_id": fence.task_id,
            "token": fence.token,
            "from": fence.taken_over_from,
            "cause": fence.cause,
            "holder_started_at": fence.holder_started_at,
        },
    )


def _closed_event(letter: DeadLetter) -> Event:
    assert letter.resolved_at is not None
    return Event(
        letter.resolved_at,
        "dead_letter_closed",
        f"dead letter {letter.pk} {verdict.closed_text(letter)}",
        {
            "dead_letter": letter.pk,
            "status": letter.status,
            "resolved_by": letter.resolved_by,
            "replayed_task_id": letter.replayed_task_id,
        },
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
            "resolved_at": letter.resolved_at,
            "resolved_by": letter.resolved_by,
        },
    )


def _replay_result(letter: DeadLetter, attempts: list[Attempt], letters: list[DeadLetter]) -> str:
    """What a replay led to: its last attempt's outcome, or the letter it became."""
    again = [d for d in letters if d.task_id == letter.replayed_task_id]
    if again:
        return f", which was dead-lettered again ({again[0].reason}, dead letter {again[0].pk})"
    runs = [a for a in attempts if a.task_id == letter.replayed_task_id]
    return f", which ended {runs[-1].outcome}" if runs else ", which has not run yet"
