"""The attempt audit trail: one row per execution of a handler.

Answers "why was this job repeated?": every attempt of a key, its number, whether the
broker redelivered it, which worker ran it, how it ended, and when the next one is due.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from django.db import DatabaseError, connections

from django_outbox.conf import settings
from django_outbox.models import Attempt, Outcome

logger = logging.getLogger("django_outbox.audit")


def record_attempt(
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
    row_id: int | None = None,
    in_effect: bool = False,
) -> int | None:
    """Write the attempt row; return its id.

    ``in_effect=True``: the row joins the effect's transaction, so an ``applied`` row
    exists exactly when the effect committed, and the effect's commit is the only one
    (one WAL flush per job instead of two). A failure then rolls the effect back too.

    Otherwise the row is written on its own (autocommit: it outlives a rolled-back
    effect), or updates ``row_id`` when the handler failed after its effect committed.
    A failure to write it is logged with every field and does not fail the job: the
    log line keeps the evidence.
    """
    fields = dict(
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
        error_message=error_message,
        retry_delay=retry_delay,
        next_attempt_at=(
            finished_at + dt.timedelta(seconds=retry_delay) if retry_delay is not None else None
        ),
        correlation_id=correlation_id[:255],
        external_request_id=external_request_id[:255],
        replay_of=replay_of,
    )
    manager = Attempt.objects.using(settings.database)

    def write() -> int:
        if row_id is not None:
            manager.filter(pk=row_id).update(**fields)
            return row_id
        return _insert(fields)

    if in_effect:
        return write()
    try:
        return write()
    except DatabaseError:
        logger.exception("could not record attempt", extra={"attempt_row": fields})
        return None


def _insert(fields: dict[str, Any]) -> int:
    """One INSERT ... RETURNING id, without building a model instance.

    This runs once per job on the hot path; the ORM's ``create()`` costs about as much
    Python time as the round trip itself. Column names equal the field names.
    """
    columns = list(fields)
    sql = (
        f"INSERT INTO {Attempt._meta.db_table} ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))}) RETURNING id"
    )
    connection = connections[settings.database]
    with connection.cursor() as cursor:
        cursor.execute(sql, [_adapt(connection, fields[c]) for c in columns])
        return int(cursor.fetchone()[0])


def _adapt(connection: Any, value: Any) -> Any:
    # What the ORM would do: enum members as their value, datetimes in the backend's
    # own format (SQLite stores text).
    if isinstance(value, dt.datetime):
        return connection.ops.adapt_datetimefield_value(value)
    return getattr(value, "value", value)
