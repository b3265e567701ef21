"""How a job that did not succeed ends: retried, dead-lettered, or deferred for the database.

The pipeline (``celery_explicit.pipeline``) runs the steps and the handler; when the
handler raised, or a step answered that the job cannot go on, it hands the job here:

- ``handler_failed``: the task's retry policy classifies the error (``classify``: an
  operational database error, a deadlock or a serialization failure, is transient
  whatever the task declares). A transient error, or an unclassified one the task
  retries (``unclassified``), is retried with backoff until ``max_attempts``, then
  dead-lettered as exhausted; any other is dead-lettered at once.
- ``defer_for_outage``, ``wait_for_database``: a database this process cannot write is
  not the job's fault (``outage_cause``). The job is published again after the outage's
  backoff (``celery_explicit.database_outage``), its attempts kept.
- ``dead_letter``: the message is kept as evidence, sensitive values scrubbed from the
  error Celery goes on to log. If the dead letter itself cannot be written the message
  is kept instead and tried again later: once it is acked, the dead letter is its only
  copy.
"""

from __future__ import annotations

import random
from typing import Any, NoReturn

from django.db import DatabaseError

from celery_explicit import database_outage, job_log, metrics, records, republish
from celery_explicit.conf import settings
from celery_explicit.execution import Execution
from celery_explicit.outcomes import Outcome
from celery_explicit.retry_policy import Classification
from celery_explicit.steps import Job

logger = job_log.get_logger("celery_explicit")
_rng = random.SystemRandom()


def handler_failed(
    task: Any, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception
) -> None:
    """The handler raised: retry it with backoff, or dead-letter it, by its class."""
    execution = job.execution
    policy = task.contract.retry
    kind = classify(task, exc)
    if kind is Classification.RETRY or (
        kind is Classification.UNCLASSIFIED and policy.should_retry(exc)
    ):
        if execution.attempt < policy.max_attempts:
            delay = policy.delay(execution.attempt, exc, rng=_rng)
            metrics.retries_scheduled.labels(task.name, type(exc).__name__).inc()
            records.attempt(
                execution, job.request, Outcome.RETRY_SCHEDULED, exc=exc, retry_delay=delay
            )
            # Celery's max_retries is off (None): max_attempts is the limit.
            raise republish.retry(task, exc, delay)
        name = "EXHAUSTED"
    elif kind is Classification.UNCLASSIFIED:
        name = "FAILED_UNCLASSIFIED"
    else:
        name = "FAILED_PERMANENT"
    dead_letter(task, args, kwargs, exc, execution, name)


def outage_cause(exc: BaseException) -> str | None:
    """Why the database is unavailable, when ``exc`` says it is (and the switch is on)."""
    return database_outage.cause_of(exc) if settings.database_outage else None


def classify(task: Any, exc: BaseException) -> Classification:
    """The task's retry policy, except that an operational database error (a deadlock,
    a serialization failure) is transient whatever the task declares."""
    if settings.database_outage and database_outage.transient(exc):
        return Classification.RETRY
    return task.contract.retry.classify(exc)  # type: ignore[no-any-return]


def defer_for_outage(
    task: Any,
    job: Job,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exc: BaseException,
    cause: str,
) -> NoReturn:
    """The handler met a database it cannot write: not the job's fault. Deferred with
    the outage's backoff, its attempts kept; recorded where the database lets us."""
    execution = job.execution
    delay = database_outage.seen(task.name, cause, job.request)
    records.attempt(
        execution, job.request, Outcome.DATABASE_UNAVAILABLE, exc=exc, retry_delay=delay
    )
    republish.defer(task, execution, args, kwargs, delay, by=database_outage.NAME)


def wait_for_database(
    task: Any,
    execution: Execution,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cause: str,
) -> NoReturn:
    """Publish the job again after the outage's backoff, its attempts kept."""
    delay = database_outage.seen(task.name, cause, request)
    republish.defer(task, execution, args, kwargs, delay, by=database_outage.NAME)


def dead_letter(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exc: BaseException,
    execution: Execution,
    name: str,
) -> None:
    request = task.request
    if execution.secrets:
        # The error goes on to Celery, which logs it ("raised expected: ...") and may
        # store it as the result: its text must not quote a sensitive value either.
        exc.args = tuple(execution.scrub(a) if isinstance(a, str) else a for a in exc.args)
    try:
        records.dead_letter(
            request,
            args,
            kwargs,
            exc,
            execution=execution,
            name=name,
            signature=task.contract.signature,
        )
    except DatabaseError as db_exc:
        # The dead letter is the only copy once the message is acked: keep the
        # message instead, and try again later, its attempts kept (the same job
        # comes back to the same ending).
        logger.exception(
            "could not record dead letter; deferring the message",
            extra={"task": task.name, "job_id": request.id, "idempotency_key": execution.key},
        )
        if not settings.database_outage:
            raise republish.retry(task, db_exc, _rng.uniform(1.0, 10.0)) from db_exc
        cause = database_outage.cause_of(db_exc) or "dead_letter_write"
        wait_for_database(task, execution, request, args, kwargs, cause)
