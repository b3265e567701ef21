"""Explain a job from the stored data alone: what happened to it, in time order, and why.

``manage.py explicit_explain <what>`` answers the three questions of a 3 a.m. incident (which
entities, did the effect happen, why was the job repeated) from the rows the job path
left: attempts, the ledger entry, fences, dead letters and outbox rows. ``<what>`` is an
idempotency key, a task id, a dead letter id, an outbox event id, or a business id
found as one ``:``-separated part of keys (``1003`` finds ``order:1003:ship``). Each
match is one key, with the rule it matched by (``incident.lookup``): its timeline
(``incident.timeline``, one line per row) and a verdict (``incident.verdict``).

The time since the previous event is on each line, so the wait in the queue, a
deferral or a retry's delay reads as a span.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db.models import Q

from django_outbox import times
from django_outbox.conf import settings
from django_outbox.errors import OutboxError
from django_outbox.incident import timeline, verdict
from django_outbox.incident.lookup import MAX_MATCHES, PRINTABLE, resolve, uuid_or_none
from django_outbox.incident.timeline import Event
from django_outbox.incident.verdict import stamp
from django_outbox.models import Attempt, DeadLetter, Fence, ProcessedOperation
from django_outbox.store import cancellations

# Event, stamp and uuid_or_none: importable from here, where the job page and the
# replay plan read them with the explanation.
__all__ = ["ExplainError", "Event", "Explanation", "explain", "stamp", "uuid_or_none"]


class ExplainError(OutboxError):
    """``explain`` was given nothing it can look up (the message says why)."""


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
    if not PRINTABLE.match(query):
        raise ExplainError(
            f"cannot explain {what!r}: give an idempotency key, a task id, a dead letter "
            "id, an outbox event id or a business id (printable, at most 255 characters)"
        )
    keys, task_ids = resolve(query)
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
    events = list(timeline.outbox_events(all_tasks))
    outboxed = {e.data["event_id"] for e in events}
    events += timeline.publish_events(attempts, outboxed)
    events += timeline.slot_events(all_tasks)
    events += [timeline.attempt_event(a, attempts, fences) for a in attempts]
    events += [timeline.unrecorded_event(f, attempts) for f in verdict.unrecorded(fences, attempts)]
    events += [timeline.fence_event(f, attempts) for f in fences]
    cancelled = cancellations.of_jobs(set(all_tasks), {key} | {a.idempotency_key for a in attempts})
    events += [timeline.cancellation_event(c) for c in cancelled]
    if ledger is not None:
        events.append(
            Event(
                ledger.processed_at,
                "effect",
                f"effect applied: ledger entry for {ledger.key} by task {ledger.task_id}"
                + (f", result {ledger.result_ref}" if ledger.result_ref else ""),
                {"task_id": ledger.task_id, "result_ref": ledger.result_ref},
            )
        )
    events += [timeline.letter_event(letter, attempts, letters) for letter in letters]
    events += [
        timeline.closed_event(letter) for letter in letters if letter.resolved_at is not None
    ]
    events.sort(key=lambda event: event.at)
    for before, event in itertools.pairwise(events):
        event.since = (event.at - before.at).total_seconds()
    return Explanation(
        key=key,
        task_ids=all_tasks,
        events=events,
        verdict=verdict.verdict(attempts, ledger, letters, fences, cancelled),
    )
