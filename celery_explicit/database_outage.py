"""Database outage: a database that cannot be written is an outage, not a bad job.

A connection refused or lost, a server shutting down or starting up, too many
connections, a disk full, a transaction refused because the server is read-only (a
standby not yet promoted, ``default_transaction_read_only``): none of these says
anything about the job. Classified by the task's retry policy, such an error
dead-letters the job (``unclassified`` is permanent by default), and its dead letter
cannot be written either; retried, it spends the job's attempts while the database is
away, so the first real transient error after the outage finds them spent.

So, whatever the task declares:

- an **outage** (the SQLSTATE classes in ``_OUTAGE``, or a connection error that
  carries no SQLSTATE) defers the job: published again after a capped backoff
  (equal jitter, from 1 s up to ``EXPLICIT_DATABASE_OUTAGE_BACKOFF_CAP``), with the
  same retry count, never dead-lettered for it, and not counted by a downstream's
  breaker. The process remembers it saw one: until the database answers a probe (one
  ``SHOW transaction_read_only`` on PostgreSQL), the next jobs are deferred before
  their handler runs, so a handler's calls before its effect (the warehouse call) are
  not repeated against a database that cannot record them;
- any other **operational** error (a serialization failure, a deadlock, a lock or
  statement timeout) is transient: retried within the job's ``max_attempts``.

Counted in ``explicit_database_outage_deferrals_total{task, cause}``. A deferral
after the handler ran writes an attempt row ``database_unavailable`` when the database
takes it (the log line keeps it otherwise); the attempt that finally runs carries the
count in its ``deferrals`` (``{"database": n}``).

Not for SQLite or MySQL's own wording: their connection errors carry no SQLSTATE, so
every ``OperationalError`` they raise counts as an outage (SQLite's "no such table"
included: it defers until fixed, and the metric shows it).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from celery_explicit import job_log, metrics
from celery_explicit.conf import settings
from celery_explicit.headers import DEFERRALS_HEADER
from celery_explicit.steps import RUN, Decision, Defer, Job, Step

logger = job_log.get_logger("celery_explicit.database_outage")

#: The step's name: the deferral counts' key and the metric's word.
NAME = "database"
#: Seconds of the first deferral's backoff (then doubled per deferral, capped).
BACKOFF_BASE = 1.0

#: SQLSTATE (or its two-character class) -> cause, for the errors that mean the
#: database is away rather than that this job is wrong (PostgreSQL, appendix A).
_OUTAGE = {
    "08": "connection",  # connection exception: refused, lost, failed
    "53": "resources",  # disk full, out of memory, too many connections
    "57P01": "shutdown",  # admin_shutdown: a fast or smart stop
    "57P02": "shutdown",  # crash_shutdown: another backend crashed, all reset
    "57P03": "starting",  # cannot_connect_now: starting up or in recovery
    "57P05": "connection",  # idle_session_timeout
    "25006": "read_only",  # read_only_sql_transaction
}

_rng = random.SystemRandom()
#: When this process last saw an outage (monotonic); None while none is suspected.
_suspected_at: float | None = None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The error, then what it was raised from (a handler's own error wrapping the
    database's), a few links deep."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 8:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a Django database error: on the driver's error it wraps
    (psycopg 3 ``sqlstate``, psycopg2 ``pgcode``)."""
    for link in (exc, exc.__cause__):
        state = getattr(link, "sqlstate", None) or getattr(link, "pgcode", None)
        if isinstance(state, str) and state:
            return state
    return None


def _database_error(exc: BaseException) -> DatabaseError | None:
    for link in _chain(exc):
        if isinstance(link, DatabaseError):
            return link
    return None


def cause_of(exc: BaseException) -> str | None:
    """``"connection"``, ``"read_only"``, ...: why the database is unavailable, when
    ``exc`` (or an error it was raised from) says it is; None otherwise."""
    error = _database_error(exc)
    if error is None:
        return None
    state = _sqlstate(error)
    if state is None:
        # A driver's own failure to reach the server carries no SQLSTATE.
        return "connection" if isinstance(error, OperationalError | InterfaceError) else None
    return _OUTAGE.get(state) or _OUTAGE.get(state[:2])


def transient(exc: BaseException) -> bool:
    """An operational database error that is not an outage (a serialization failure,
    a deadlock, a lock or statement timeout): worth retrying, within the budget."""
    error = _database_error(exc)
    return isinstance(error, OperationalError) and cause_of(error) is None


def backoff(deferrals: int) -> float:
    """Seconds before the ``deferrals``-th try (1-based): equal jitter, so no deferral
    comes back sooner than half its step (a full-jitter zero would re-run at once)."""
    ceiling = min(settings.database_outage_backoff_cap, BACKOFF_BASE * 2 ** min(deferrals - 1, 30))
    return float(ceiling / 2 + _rng.uniform(0.0, ceiling / 2))


def deferrals_of(request: Any) -> int:
    """How often this job was deferred for the database already (its header)."""
    counts = getattr(request, DEFERRALS_HEADER, None)
    value = counts.get(NAME, 0) if isinstance(counts, dict) else 0
    return value if isinstance(value, int) else 0


def seen(task_name: str, cause: str, request: Any) -> float:
    """An outage reached this job: remember it, count it; the seconds to defer it."""
    global _suspected_at
    _suspected_at = time.monotonic()
    metrics.database_outage_deferrals.labels(task_name, cause).inc()
    return backoff(deferrals_of(request) + 1)


def probe() -> str | None:
    """None when the database takes writes now; else the cause of the outage."""
    global _suspected_at
    connection = connections[settings.database]
    try:
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SHOW transaction_read_only")
                row = cursor.fetchone()
            if row and str(row[0]).lower() == "on":
                return "read_only"
        else:
            connection.ensure_connection()
    except DatabaseError as exc:
        if not connection.in_atomic_block:
            # A broken connection is not reused: the next probe connects again.
            connection.close()
        return cause_of(exc) or "connection"
    _suspected_at = None
    return None


def suspected() -> bool:
    return _suspected_at is not None


class DatabaseStep(Step):
    """First, and free until an outage is seen: while one is suspected in this process,
    a job is deferred before anything runs unless the database answers the probe."""

    name = NAME

    def before_run(self, job: Job) -> Decision:
        if _suspected_at is None:
            return RUN
        cause = probe()
        if cause is None:
            logger.info(
                "database reachable again; running jobs",
                extra={**job.execution.log_fields(), "layer": "delivery"},
            )
            return RUN
        delay = seen(self.task_name, cause, job.request)
        return Defer(delay, f"database unavailable ({cause})", {"cause": cause})
