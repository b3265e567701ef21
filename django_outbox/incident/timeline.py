"""The lines of a job's timeline: one ``Event`` per thing that happened to it.

Every execution is on the timeline: each attempt row, and an execution that left none
(a process killed mid-job) from the fence row of the takeover that followed it (its
host, pid, start and why it lost its lease). Each line is written from one row;
``explain`` puts them in time order and adds the span since the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery_explicit.outcomes import Outcome
from celery_explicit.periodic import format_slot
from django_outbox.conf import settings
from django_outbox.incident import verdict
from django_outbox.incident.lookup import uuid_or_none
from django_outbox.incident.verdict import stamp
from django_outbox.models import Attempt, Cancellation, DeadLetter, Fence, OutboxEvent
from django_outbox.store import periodic_slots

__all__ = [
    "Event",
    "attempt_event",
    "closed_event",
    "fence_event",
    "letter_event",
    "outbox_events",
    "publish_events",
    "slot_events",
    "unrecorded_event",
]

#: Why an execution lost its lease, as a timeline line says it.
_LOST_LEASE = {
    "holder_dead": "its process had died",
    "lease_expired": "its lease had run out (it stopped extending it: stopped, "
    "partitioned, or killed on another host)",
    "": "its cause was not recorded",
}


@dataclass
class Event:
    at: datetime
    #: outbox, published, slot, attempt, execution, takeover, fence, cancelled, effect,
    #: dead_letter
    kind: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)
    #: Seconds since the previous event of the job (None for the first): a wait in the
    #: queue, a deferral or a retry's delay reads as a span.
    since: float | None = None


def outbox_events(task_ids: list[str]) -> list[Event]:
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


def publish_events(attempts: list[Attempt], outboxed: set[str]) -> list[Event]:
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


def attempt_event(attempt: Attempt, attempts: list[Attempt], fences: list[Fence]) -> Event:
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
    if attempt.app_version:
        notes.append(f"version {attempt.app_version}")
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
        "app_version": attempt.app_version,
    }
    return Event(attempt.started_at, "attempt", text, data)


def unrecorded_event(fence: Fence, attempts: list[Attempt]) -> Event:
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


def fence_event(fence: Fence, attempts: list[Attempt]) -> Event:
    if not fence.taken_over_from:
        return Event(
            fence.taken_over_at,
            "fence",
            f"task {fence.task_id} delivered again, its execution lease free (no earlier "
            "execution held it, or its record was lost in a Redis failover): fencing token "
            f"{fence.token} written, so no earlier execution can commit",
            {"task_id": fence.task_id, "token": fence.token, "cause": fence.cause},
        )
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


def cancellation_event(row: Cancellation) -> Event:
    what = f"task {row.task_id}" if row.task_id else f"every job of key {row.idempotency_key}"
    return Event(
        row.requested_at,
        "cancelled",
        f"{what} cancelled by {row.requested_by}"
        + (f": {row.reason}" if row.reason else "")
        + " (cancellable jobs of it do not run, and no effect of it commits after this)",
        {
            "task_id": row.task_id,
            "key": row.idempotency_key,
            "by": row.requested_by,
            "reason": row.reason,
        },
    )


def slot_events(task_ids: list[str]) -> list[Event]:
    """A job a beat published for a periodic entry: which slot it ran for."""
    return [
        Event(
            row.published_at,
            "slot",
            f"published by beat {row.published_by or '?'} for slot {format_slot(row.slot)} "
            f"of periodic entry {row.entry!r} (as task {row.task_id})",
            {"task_id": row.task_id, "entry": row.entry, "slot": format_slot(row.slot)},
        )
        for row in periodic_slots.for_tasks(task_ids)
    ]


def closed_event(letter: DeadLetter) -> Event:
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


def letter_event(letter: DeadLetter, attempts: list[Attempt], letters: list[DeadLetter]) -> Event:
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
