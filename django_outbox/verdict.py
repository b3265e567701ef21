"""The verdict of ``explain``: a job's story in one or two sentences, from its rows.

"effect applied once at 03:12:07.412 by worker-2 pid 811; ran 3 times: 1 redelivery by
the broker; 1 lease takeover after the lease expired (from worker-1 pid 790); 1 stale
commit fenced." Every count is read off the attempt, ledger, dead letter and fence
rows ``explain`` gathered; nothing is inferred that a row does not say.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from celery_explicit.outcomes import Outcome
from django_outbox.models import Attempt, DeadLetter, Fence, ProcessedOperation


def stamp(at: datetime) -> str:
    """A timestamp with milliseconds, in UTC (what every line of a timeline shows)."""
    return at.strftime("%Y-%m-%d %H:%M:%S.") + f"{at.microsecond // 1000:03d}"


def deferral_text(counts: dict[str, int]) -> str:
    """``{"execution_lease": 2}`` as words: why the job waited, and how often."""
    why = {
        "ordering": "waiting for its entity's turn",
        "execution_lease": "another execution held the job",
        "downstream": "the downstream was busy or open",
        "database": "the database could not be written",
    }
    return ", ".join(f"{n}x {why.get(step, step)}" for step, n in sorted(counts.items()))


def _holder(fence: Fence, attempts: list[Attempt]) -> str:
    """The execution a takeover was taken from, named as its attempt row names it
    (``worker@host pid N``) where that attempt is among the job's; the fence row keeps
    only ``host:pid``."""
    host, _, pid = fence.taken_over_from.rpartition(":")
    for attempt in attempts:
        if str(attempt.worker_pid) == pid and attempt.worker_host.rsplit("@", 1)[-1] == host:
            return f"{attempt.worker_host} pid {pid}"
    return fence.taken_over_from


def verdict(
    attempts: list[Attempt],
    ledger: ProcessedOperation | None,
    letters: list[DeadLetter],
    fences: list[Fence],
) -> str:
    outcomes = Counter(Outcome(a.outcome) for a in attempts)
    applied = [a for a in attempts if a.outcome == Outcome.APPLIED]
    if ledger is not None and applied:
        first = applied[0]
        effect = (
            f"effect applied once at {stamp(ledger.processed_at)} by {first.worker_host} "
            f"pid {first.worker_pid}"
        )
    elif ledger is not None:
        effect = f"effect applied once at {stamp(ledger.processed_at)}"
    else:
        effect = "effect not applied"
    open_letters = [letter for letter in letters if letter.status == "open"]
    if ledger is None and open_letters:
        letter = open_letters[-1]
        error = letter.error_class.rsplit(".", 1)[-1] or "no error class"
        effect += (
            f": dead-lettered ({letter.reason}, {error}), "
            f"waiting for an operator (dead letter {letter.pk})"
        )
    elif ledger is None and attempts and attempts[-1].outcome == Outcome.RETRY_SCHEDULED:
        due = attempts[-1].next_attempt_at
        effect += f" yet: a retry is due at {stamp(due)}" if due else " yet: a retry is due"
    elif ledger is None and attempts and attempts[-1].outcome == Outcome.DATABASE_UNAVAILABLE:
        due = attempts[-1].next_attempt_at
        effect += " yet: deferred while the database could not be written" + (
            f", next try at {stamp(due)}" if due else ""
        )
    causes = []
    if ledger is not None and open_letters:
        reasons = ", ".join(f"{n} {r}" for r, n in Counter(d.reason for d in open_letters).items())
        ids = ", ".join(str(d.pk) for d in open_letters)
        causes.append(f"dead-lettered: {reasons} (dead letter {ids})")
    retries = [a for a in attempts if a.outcome == Outcome.RETRY_SCHEDULED]
    if retries:
        errors = Counter(a.error_class.rsplit(".", 1)[-1] or "self.retry()" for a in retries)
        causes.append(
            f"{len(retries)} retr{'y' if len(retries) == 1 else 'ies'} after "
            + ", ".join(f"{name}" + (f" x{n}" if n > 1 else "") for name, n in errors.items())
        )
    redelivered = sum(1 for a in attempts if a.redelivered)
    if redelivered:
        causes.append(f"{redelivered} redeliver{'y' if redelivered == 1 else 'ies'} by the broker")
    fenced = outcomes[Outcome.FENCED]
    if fences:
        holders = ", ".join(_holder(f, attempts) for f in fences)
        causes.append(
            f"{len(fences)} lease takeover{'s' if len(fences) > 1 else ''} after the "
            f"lease expired (from {holders})"
        )
    if fenced:
        causes.append(f"{fenced} stale commit{'s' if fenced > 1 else ''} fenced")
    absorbed = outcomes[Outcome.ALREADY_APPLIED]
    if absorbed:
        causes.append(f"{absorbed} duplicate execution{'s' if absorbed > 1 else ''} absorbed")
    deferred: Counter[str] = Counter()
    last_of_task = {a.task_id: a for a in attempts}  # counts are carried, so the last
    for last in last_of_task.values():
        deferred.update(last.deferrals or {})
    if total := sum(deferred.values()):
        why = deferral_text(dict(deferred))
        causes.append(f"deferred {total} time{'s' if total > 1 else ''} ({why})")
    replays = sum(1 for a in attempts if a.replay_of is not None)
    if replays:
        causes.append(f"replayed from the dead letters ({replays} attempt(s))")
    runs = len(attempts)
    ran = f"ran {runs} time{'s' if runs != 1 else ''}" if runs else "never ran"
    return f"{effect}; {ran}" + (f": {'; '.join(causes)}." if causes else ".")
