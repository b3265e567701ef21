"""The attempts: one attempt row per execution of a handler.

Answers "why was this job repeated?": every attempt of a key, its number, whether the
broker redelivered it, which worker ran it, how it ended, and when the next one is due.

An attempt that ran an effect block writes its row inside the effect's transaction
(``insert_statement``, handed to ``ledger.effect(before_commit=...)``): an ``applied``
row exists exactly when the effect committed, and the job commits once. Other attempts
write their row on their own when they end (``record_attempt``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from django.db import DatabaseError, connections

from celery_explicit import job_log
from celery_explicit.records import attempt_fields
from celery_explicit.store import Statement
from django_outbox.conf import settings
from django_outbox.db import attempts_sql

logger = job_log.get_logger("django_outbox.store.attempts")

# The row's columns are built by the job path's recorder; kept importable from here.
__all__ = ["attempt_fields", "insert_statement", "record_attempt"]


def insert_statement(fields: Mapping[str, Any], *, replace: bool = False) -> Statement:
    """SQL writing the row, to run inside the effect's transaction.

    ``replace=True``: this attempt already wrote its row in an earlier effect block of
    the same handler; update that row instead of adding a second one.
    """
    connection = connections[settings.database]
    if replace:
        assignments = ", ".join(f"{c} = %s" for c in fields)
        return (
            attempts_sql.REPLACE.format(assignments=assignments),
            [*_params(connection, fields), *_locator(connection, fields)],
        )
    sql = attempts_sql.INSERT.format(
        columns=", ".join(fields), placeholders=", ".join(["%s"] * len(fields))
    )
    return (sql, _params(connection, fields))


def record_attempt(fields: Mapping[str, Any], *, replace: bool = False) -> None:
    """Write the row on its own (autocommit: it outlives a rolled-back effect).

    ``replace=True`` updates the row an effect block already committed for this attempt
    (the handler failed after its effect). A failure to write is logged with every
    field and does not fail the job: the log line keeps the evidence.
    """
    try:
        with connections[settings.database].cursor() as cursor:
            if replace:
                cursor.execute(*insert_statement(fields, replace=True))
                if cursor.rowcount:
                    return
                # The row it would replace rolled back with an outer transaction.
            cursor.execute(*insert_statement(fields))
    except DatabaseError:
        logger.exception("could not record attempt", extra={"attempt_row": fields})


#: What every backend takes as it is: most of a row, passed without a call per column.
_AS_IS = frozenset({str, int, float, bool, type(None)})


def _params(connection: Any, fields: Mapping[str, Any]) -> list[Any]:
    return [
        value if type(value) in _AS_IS else _adapt(connection, value) for value in fields.values()
    ]


def _locator(connection: Any, fields: Mapping[str, Any]) -> list[Any]:
    return [fields["task_id"], fields["attempt"], _adapt(connection, fields["started_at"])]


def _adapt(connection: Any, value: Any) -> Any:
    # What the ORM would do: enum members as their value, datetimes in the backend's
    # own format (SQLite stores text).
    if isinstance(value, dt.datetime):
        return connection.ops.adapt_datetimefield_value(value)
    if isinstance(value, dict):
        return json.dumps(value)  # a JSON column (the deferral counts)
    return getattr(value, "value", value)
