"""What a worker left of a job, as reconciliation reads it: has the job ended?

A job has ended when its effect is in the ledger, it is a dead letter, or an attempt
ended it (applied, failed, refused...). An attempt after which the job goes on (a retry
scheduled, a deferral while the database was down, a stale copy fenced) says the job
was received once, not that its next message will be: reconciliation follows such a
job by its latest attempt until it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from django_outbox.models import Attempt, DeadLetter, Outcome, ProcessedOperation

#: Attempts after which the job goes on: another message of it is due (a retry, a
#: deferral), or the live execution is another one (a stale copy fenced).
UNENDED = frozenset({Outcome.RETRY_SCHEDULED, Outcome.DATABASE_UNAVAILABLE, Outcome.FENCED})


@dataclass(frozen=True)
class Unended:
    """The latest attempt of a job that has not ended: its number, when it ended (its
    next message was published then, epoch s) and when that message is due."""

    attempt: int
    sent: float
    next_due: float


def of(ids: set[str], *, using: str) -> tuple[set[str], dict[str, Unended]]:
    """The ids among ``ids`` whose job has ended (a ledger entry, a dead letter, an
    attempt that ended it), and for the others with attempts the latest of them."""
    ended: set[str] = set()
    for model in (ProcessedOperation, DeadLetter):
        ended.update(
            model.objects.using(using).filter(task_id__in=ids).values_list("task_id", flat=True)
        )
    unended: dict[str, Unended] = {}
    rows = (
        Attempt.objects.using(using)
        .filter(task_id__in=ids - ended)
        .order_by("task_id", "finished_at")
        .values_list("task_id", "outcome", "attempt", "finished_at", "next_attempt_at")
    )
    for task_id, outcome, attempt, finished_at, next_attempt_at in rows:
        if outcome not in UNENDED:
            ended.add(task_id)
            continue
        due = next_attempt_at or finished_at
        unended[task_id] = Unended(
            attempt=attempt, sent=finished_at.timestamp(), next_due=due.timestamp()
        )
    return ended, {k: v for k, v in unended.items() if k not in ended}
