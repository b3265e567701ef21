"""The recorder: how an attempt ended, as a row, a metric and a log line.

Every ending of an execution goes through here, so the attempt trail, the metrics and
the logs tell the same story from the same facts. The rows are written by the store
that ``django_outbox`` registers (``celery_explicit.store``).
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
import os
import traceback as tb
from typing import Any

from django.utils import timezone

from celery_explicit import app_version, job_log, metrics, sensitive, store
from celery_explicit.errors import qualname
from celery_explicit.execution import Execution, delivery, redelivered
from celery_explicit.headers import (
    DEFERRALS_HEADER,
    PUBLISHED_VIA_HEADER,
    REPLAY_HEADER,
    SENT_AT_HEADER,
    correlation_of,
)
from celery_explicit.outcomes import DeadLetterReason, Outcome

logger = job_log.get_logger("celery_explicit")


def attempt_fields(
    *,
    task_id: str,
    task_name: str,
    idempotency_key: str,
    attempt: int,
    redelivered: bool,
    worker_host: str,
    worker_pid: int,
    started_at: dt.datetime,
    finished_at: dt.datetime,
    outcome: Outcome,
    error_class: str = "",
    error_message: str = "",
    retry_delay: float | None = None,
    correlation_id: str = "",
    external_request_id: str = "",
    replay_of: int | None = None,
    published_via: str = "",
    deferrals: dict[str, int] | None = None,
    published_key: str = "",
    sent_at: dt.datetime | None = None,
    version: str | None = None,
) -> dict[str, Any]:
    """The columns of one attempt row (column names equal the field names).
    ``version``: the code's (``app_version.current()`` unless given)."""
    return dict(
        task_id=task_id,
        task_name=task_name,
        idempotency_key=idempotency_key,
        attempt=attempt,
        redelivered=redelivered,
        worker_host=worker_host[:255],
        worker_pid=worker_pid,
        started_at=started_at,
        finished_at=finished_at,
        duration_ms=(finished_at - started_at).total_seconds() * 1000.0,
        outcome=outcome,
        error_class=error_class[:255],
        error_message=error_message.replace("\x00", "\\x00"),
        retry_delay=retry_delay,
        next_attempt_at=(
            finished_at + dt.timedelta(seconds=retry_delay) if retry_delay is not None else None
        ),
        correlation_id=correlation_id[:255],
        external_request_id=external_request_id[:255],
        replay_of=replay_of,
        published_via=published_via[:16],
        deferrals=deferrals or None,
        published_key=published_key[:255],
        sent_at=sent_at,
        app_version=app_version.current() if version is None else version[:64],
    )


def fields_of(
    execution: Execution,
    request: Any,
    outcome: Outcome,
    *,
    exc: BaseException | None = None,
    retry_delay: float | None = None,
    note: str = "",
) -> dict[str, Any]:
    """The attempt row of ``execution`` ending with ``outcome``."""
    return attempt_fields(
        task_id=execution.task_id,
        task_name=execution.task_name,
        idempotency_key=execution.key,
        attempt=execution.attempt,
        # A deferred redelivery runs as a re-published copy: the header keeps the flag.
        redelivered=redelivered(request),
        worker_host=str(request.hostname or ""),
        worker_pid=os.getpid(),
        started_at=execution.started_at,
        finished_at=timezone.now(),
        outcome=outcome,
        error_class=qualname(exc),
        error_message=execution.scrub(str(exc)[:4000]) if exc else note,
        retry_delay=retry_delay,
        correlation_id=execution.correlation_id,
        external_request_id=execution.external_request_id,
        replay_of=_int_or_none(getattr(request, REPLAY_HEADER, None)),
        published_via=str(getattr(request, PUBLISHED_VIA_HEADER, None) or ""),
        deferrals=_counts(getattr(request, DEFERRALS_HEADER, None)),
        published_key=execution.published_key,
        sent_at=_sent_at(request),
    )


def attempt(
    execution: Execution,
    request: Any,
    outcome: Outcome,
    *,
    exc: BaseException | None = None,
    retry_delay: float | None = None,
    note: str = "",
) -> None:
    """Record how the attempt ended, when no effect block recorded it already."""
    fields = fields_of(execution, request, outcome, exc=exc, retry_delay=retry_delay, note=note)
    # An effect block may have committed this attempt's row before the handler
    # failed: update it rather than add a second row for one attempt.
    store.get().record_attempt(fields, replace=execution.effect_row_written)
    execution.recorded = True
    execution.line_pending = False  # this ending's line replaces the commit's
    emit(execution, outcome, exc=exc, retry_delay=retry_delay)


_version_announced = False


def _announce_version() -> None:
    """``explicit_app_version_info{version}`` = 1, once per process: the metrics say
    which code the attempts counted beside it came from (a deploy's versions side by
    side while it rolls)."""
    global _version_announced
    if not _version_announced:
        metrics.app_version_info.labels(app_version.current()).set(1)
        _version_announced = True


def emit(
    execution: Execution,
    outcome: Outcome,
    *,
    exc: BaseException | None = None,
    retry_delay: float | None = None,
) -> None:
    """The attempt's metric and its one log line (its row is written by the caller).

    INFO for an attempt that did its job or will try again, WARNING for one that ended
    on a declared or handled failure (one line, no traceback: the dead letter keeps
    it), ERROR with the traceback only for an error nobody classified.
    """
    execution.outcome = outcome  # how it ended, for whoever reads it after (a span)
    _announce_version()
    metrics.executions.labels(execution.task_name, outcome.value).inc()
    elapsed = (timezone.now() - execution.started_at).total_seconds()
    metrics.attempt_duration_seconds.labels(execution.task_name).observe(elapsed)
    if outcome in _JOB_ENDED:
        metrics.attempts_per_job.labels(execution.task_name).observe(execution.attempt)
    level = _LEVEL.get(outcome, logging.WARNING)
    if not logger.isEnabledFor(level):
        return  # a worker at -l WARNING: the INFO line is not built for nobody
    text = f"attempt {execution.attempt} ended: {outcome.value} in {elapsed * 1000:.0f} ms"
    if exc is not None:
        text += f" ({type(exc).__name__}: {execution.scrub(str(exc))[:200]})"
    if retry_delay is not None:
        text += f"; next try in {retry_delay:.2f}s"
    if execution.deliveries > 1:
        text += f"; delivery {execution.deliveries}"
    logger.log(
        level,
        text,
        # A traceback quotes the error as raised: not logged where it holds a secret.
        exc_info=exc
        if level >= logging.ERROR and exc is not None and not execution.secrets
        else None,
        extra={
            **execution.log_fields(),
            "layer": "execution",
            "outcome": outcome.value,
            "retry_delay": retry_delay,
            "error_class": qualname(exc) if exc else None,
            "duration_ms": round(elapsed * 1000.0, 3),
            **{f"{part}_ms": round(ms, 3) for part, ms in execution.timings.items()},
        },
    )


#: Outcomes after which the job has no further attempt (not a retry, and not a
#: message dropped or fenced in favour of another execution of the same job).
_JOB_ENDED = frozenset(Outcome) - {
    Outcome.RETRY_SCHEDULED,
    Outcome.DEDUPLICATED,
    Outcome.FENCED,
    Outcome.DATABASE_UNAVAILABLE,
}

#: Log level of an attempt's line by its outcome; the rest are WARNING.
_LEVEL = {
    Outcome.APPLIED: logging.INFO,
    Outcome.ALREADY_APPLIED: logging.INFO,
    Outcome.SUCCEEDED: logging.INFO,
    Outcome.RETRY_SCHEDULED: logging.INFO,
    Outcome.DEDUPLICATED: logging.INFO,
    Outcome.FAILED_UNCLASSIFIED: logging.ERROR,
}


def dead_letter(
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exc: BaseException,
    *,
    execution: Execution,
    name: str,
    signature: inspect.Signature | None = None,
) -> None:
    """Keep the message as a dead letter, then record the attempt; the outcome and the
    reason share ``name``, except where the reason names the cause for the outcome's
    failure (``_REASON_OF``). A database error escapes: the caller keeps the message.

    A task's sensitive fields are kept redacted, and their values scrubbed from the
    error and traceback (``celery_explicit.sensitive``)."""
    reason = DeadLetterReason[_REASON_OF.get(name, name)]
    kept_args, kept_kwargs = list(args), dict(kwargs)
    if execution.sensitive and signature is not None:
        kept_args, kept_kwargs = sensitive.redact(execution.sensitive, signature, args, kwargs)
    store.get().record_dead_letter(
        task_id=request.id,
        task_name=execution.task_name,
        reason=reason,
        args=kept_args,
        kwargs=kept_kwargs,
        idempotency_key=execution.key,
        error_class=qualname(exc),
        error_message=execution.scrub(str(exc)[:4000]),
        traceback=execution.scrub("".join(tb.format_exception(exc))),
        # A message past its delivery limit never ran: its deliveries are what counted.
        attempts=int(getattr(exc, "deliveries", 0) or execution.attempt),
        correlation_id=correlation_of(request),
        queue=str(delivery(request, "routing_key") or ""),
        exchange=str(delivery(request, "exchange") or ""),
    )
    metrics.dead_letters.labels(execution.task_name, reason.value).inc()
    attempt(execution, request, Outcome[name], exc=exc)


#: Outcome name -> dead-letter reason name, where the two differ.
_REASON_OF = {"FAILED_PERMANENT": "PERMANENT", "FAILED_UNCLASSIFIED": "UNCLASSIFIED"}


def log(message: str, execution: Execution, **fields: Any) -> None:
    logger.info(message, extra={**execution.log_fields(), **fields})


def _counts(value: object) -> dict[str, int] | None:
    """A deferrals header as it should be stored; anything malformed is dropped."""
    if not isinstance(value, dict):
        return None
    counts = {str(k)[:32]: int(v) for k, v in value.items() if isinstance(v, int)}
    return counts or None


def _sent_at(request: Any) -> dt.datetime | None:
    """When the message was published (its ``explicit_sent_at`` header, epoch seconds);
    None when it carries none (published by something other than an ExplicitTask)."""
    value = getattr(request, SENT_AT_HEADER, None)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return dt.datetime.fromtimestamp(value, dt.UTC)
    except (OverflowError, OSError, ValueError):
        return None


def _int_or_none(value: object) -> int | None:
    try:
        return int(value) if value is not None else None  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
