"""The verdict of ``explain``: a job's story in one or two sentences, from its rows.

"effect applied once at 2026-12-02 03:12:07.412 UTC by worker-2 pid 811; ran 3 times: 1
redelivery by the broker; 1 lease takeover after its holder died (from worker-1 pid
790, which left no attempt row); 1 stale commit fenced." Every count is read off the
attempt, ledger, dead letter and fence rows ``explain`` gathered; nothing is inferred
that a row does not say.

An execution is an attempt row, or a holder a takeover names that left none (a process
killed mid-job writes no row: its fence row keeps its host, pid, start and why it lost
its lease). "Ran N times" counts both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime

from celery_explicit.outcomes import Outcome
from django_outbox import times
from django_outbox.models import (
    Attempt,
    Cancellation,
    DeadLetter,
    DeadLetterStatus,
    Fence,
    ProcessedOperation,
)

#: Why a lease was taken over, as a verdict says it (``execution_lease.TakeoverCause``).
CAUSES = {
    "holder_dead": "after its holder died",
    "lease_expired": "after the lease expired",
    "": "(its cause was not recorded)",  # a fence row written before causes were kept
}


def stamp(at: datetime | None) -> str:
    """A time as every line of a timeline shows it (``times.shown``)."""
    return times.shown(at)


#: Why a job was deferred (``Attempt.deferrals``, by step), in words.
DEFERRALS = {
    "ordering": "waiting for its entity's turn",
    "execution_lease": "another execution held the job",
    "downstream": "the downstream was busy or open",
    "rate_limit": "its key's rate limit had no room",
    "database": "the database could not be written",
}


def deferral_text(counts: dict[str, int]) -> str:
    """``{"execution_lease": 2}`` as words: why the job waited, and how often."""
    return ", ".join(f"{n}x {DEFERRALS.get(step, step)}" for step, n in sorted(counts.items()))


def holder_attempt(fence: Fence, attempts: list[Attempt]) -> Attempt | None:
    """The attempt row of the execution ``fence`` took the lease from, if it wrote one
    (a stale holder that woke up did; a killed one did not). The fence names it as
    ``host:pid``, the row as ``name@host`` and a pid."""
    host, _, pid = fence.taken_over_from.rpartition(":")
    for attempt in attempts:
        if (
            attempt.task_id == fence.task_id
            and str(attempt.worker_pid) == pid
            and attempt.worker_host.rsplit("@", 1)[-1] == host
            and attempt.started_at <= fence.taken_over_at
        ):
            return attempt
    return None


def holder_name(fence: Fence, attempts: list[Attempt]) -> str:
    """The execution a takeover was taken from: ``worker@host pid N`` where one of the
    job's attempts names that worker, else ``host pid N`` from the fence row."""
    host, _, pid = fence.taken_over_from.rpartition(":")
    for attempt in attempts:
        if str(attempt.worker_pid) == pid and attempt.worker_host.rsplit("@", 1)[-1] == host:
            return f"{attempt.worker_host} pid {pid}"
    return f"{host} pid {pid}" if host else fence.taken_over_from


#: The cause of a fence that names no holder: a redelivered job found its lease free
#: and fenced any earlier execution all the same (``execution_lease_step``).
UNLEASED = "unleased"


def takeovers(fences: list[Fence]) -> list[Fence]:
    """The fences that took a lease over from a holder they name; an ``unleased`` fence
    names none, so it is no execution and no takeover."""
    return [f for f in fences if f.taken_over_from]


def unrecorded(fences: list[Fence], attempts: list[Attempt]) -> list[Fence]:
    """Takeovers whose holder left no attempt row: executions known only from them."""
    return [f for f in takeovers(fences) if holder_attempt(f, attempts) is None]


def republished(attempts: list[Attempt]) -> list[Attempt]:
    """Attempts of a message published again with a task id and attempt number already
    run: their ``sent_at`` differs from the first's. A redelivery, or a copy the worker
    re-published (deferred), is the same message, not a second publish."""
    first: dict[tuple[str, int], Attempt] = {}
    again = []
    for attempt in attempts:
        seen = first.setdefault((attempt.task_id, attempt.attempt), attempt)
        if (
            seen is not attempt
            and attempt.sent_at is not None
            and seen.sent_at is not None
            and attempt.sent_at != seen.sent_at
            and not attempt.redelivered
            and not attempt.deferrals
        ):
            again.append(attempt)
    return again


def closed_text(letter: DeadLetter) -> str:
    """Who closed a dead letter and when: ``discarded at ... by alice``; "" when open."""
    if letter.status == DeadLetterStatus.OPEN:
        return ""
    by = f" by {letter.resolved_by}" if letter.resolved_by else ""
    text = f"{letter.status} at {times.shown(letter.resolved_at)}{by}"
    if letter.status == DeadLetterStatus.REPLAYED and letter.replayed_task_id:
        text += f" as task {letter.replayed_task_id}"
    return text


def _letter_clause(letter: DeadLetter) -> str:
    closed = closed_text(letter)
    return f"dead letter {letter.pk}, " + (closed or "open")


def verdict(
    attempts: list[Attempt],
    ledger: ProcessedOperation | None,
    letters: list[DeadLetter],
    fences: list[Fence],
    cancelled: Sequence[Cancellation] = (),
) -> str:
    outcomes = Counter(Outcome(a.outcome) for a in attempts)
    applied = [a for a in attempts if a.outcome == Outcome.APPLIED]
    if ledger is not None and applied:
        first = applied[0]
        effect = (
            f"effect applied once at {stamp(ledger.processed_at)} by {first.worker_host} "
            f"pid {first.worker_pid}" + _version(first.app_version)
        )
    elif ledger is not None:
        effect = f"effect applied once at {stamp(ledger.processed_at)}" + _version(
            ledger.app_version
        )
    else:
        effect = "effect not applied"
    letters = sorted(letters, key=lambda d: (d.last_attempt, d.pk))
    open_letters = [letter for letter in letters if letter.status == DeadLetterStatus.OPEN]
    # The letter the effect sentence is about: the newest open one, else the newest.
    named = (open_letters or letters)[-1] if ledger is None and letters else None
    if named is not None:
        error = named.error_class.rsplit(".", 1)[-1] or "no error class"
        effect += f": dead-lettered ({named.reason}, {error}), " + (
            closed_text(named) or "waiting for an operator"
        )
        effect += f" (dead letter {named.pk})"
    elif ledger is None and attempts and attempts[-1].outcome == Outcome.RETRY_SCHEDULED:
        due = attempts[-1].next_attempt_at
        effect += f" yet: a retry is due at {stamp(due)}" if due else " yet: a retry is due"
    elif ledger is None and attempts and attempts[-1].outcome == Outcome.DATABASE_UNAVAILABLE:
        due = attempts[-1].next_attempt_at
        effect += " yet: deferred while the database could not be written" + (
            f", next try at {stamp(due)}" if due else ""
        )
    causes = []
    if cancelled:
        order = cancelled[0]
        causes.append(f"cancelled by {order.requested_by} at {stamp(order.requested_at)}")
    others = [letter for letter in letters if letter is not named]
    if others:
        reasons = ", ".join(f"{n} {r}" for r, n in Counter(d.reason for d in others).items())
        clauses = "; ".join(_letter_clause(d) for d in others)
        causes.append(f"dead-lettered: {reasons} ({clauses})")
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
    again = republished(attempts)
    if again:
        causes.append(
            f"{len(again)} more publish{'es' if len(again) > 1 else ''} with a task id "
            "already run (the same task id published again)"
        )
    for cause, taken in _by_cause(fences).items():
        holders = ", ".join(_holder_text(f, attempts) for f in taken)
        causes.append(
            f"{len(taken)} lease takeover{'s' if len(taken) > 1 else ''} "
            f"{CAUSES.get(cause, f'({cause})')} (from {holders})"
        )
    fenced = outcomes[Outcome.FENCED]
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
    runs = len(attempts) + len(unrecorded(fences, attempts))
    ran = f"ran {runs} time{'s' if runs != 1 else ''}" if runs else "never ran"
    return f"{effect}; {ran}" + (f": {'; '.join(causes)}." if causes else ".")


def _version(version: str) -> str:
    """`` (version 1.4.2)``, or nothing when the row does not say."""
    return f" (version {version})" if version else ""


def _by_cause(fences: list[Fence]) -> dict[str, list[Fence]]:
    grouped: dict[str, list[Fence]] = {}
    for fence in sorted(takeovers(fences), key=lambda f: f.taken_over_at):
        grouped.setdefault(fence.cause, []).append(fence)
    return grouped


def _holder_text(fence: Fence, attempts: list[Attempt]) -> str:
    name = holder_name(fence, attempts)
    if holder_attempt(fence, attempts) is not None:
        return name
    if fence.holder_started_at is None:
        return f"{name}, which left no attempt row"
    ran = (fence.taken_over_at - fence.holder_started_at).total_seconds()
    return f"{name}, which left no attempt row, taken over {ran:.1f} s after it started"
