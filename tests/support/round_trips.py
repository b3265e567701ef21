"""Counting a job's round trips to Redis and PostgreSQL in a worker's pool process.

Imported by ``tests/celery_app.py`` when ``EXPLICIT_TEST_COUNT_ROUND_TRIPS`` is set (a
worker the round-trip test starts). Each request a client sends and waits on is one
round trip:

- Redis: each ``send_packed_command`` of redis-py (a pipeline sends its commands in one);
- PostgreSQL: each query libpq sends (``send_query*``, ``send_prepare``, ``exec*``,
  ``prepare``), counted on psycopg's pure-Python libpq wrapper, which the worker is
  started with (``PSYCOPG_IMPL=python``) because the C one cannot be wrapped.

Counted from ``task_prerun`` to ``task_postrun`` (the job in the pool process: the
steps, the handler, its effect, its attempt row, the steps' ends); each job's counts
are pushed to the Redis list ``round-trips:<tag>`` as ``<task>|<redis>|<postgresql>``.
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import task_postrun, task_prerun

COUNTS = {"redis": 0, "postgresql": 0}
_started: dict[str, tuple[int, int]] = {}

_PG_SENDS = (
    "send_query",
    "send_query_params",
    "send_query_prepared",
    "send_prepare",
    "exec_",
    "exec_params",
    "exec_prepared",
    "prepare",
)


def _counted(real: Any, what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        COUNTS[what] += 1
        return real(*args, **kwargs)

    return call


def install() -> None:
    import redis.connection
    from psycopg import pq

    if pq.__impl__ != "python":
        raise RuntimeError("counting PostgreSQL round trips needs PSYCOPG_IMPL=python")
    for name in _PG_SENDS:
        setattr(pq.PGconn, name, _counted(getattr(pq.PGconn, name), "postgresql"))
    connection = redis.connection.AbstractConnection
    connection.send_packed_command = _counted(  # type: ignore[method-assign]
        connection.send_packed_command, "redis"
    )
    task_prerun.connect(_before, weak=False)
    task_postrun.connect(_after, weak=False)


def _before(task_id: str | None = None, **_: Any) -> None:
    _started[str(task_id)] = (COUNTS["redis"], COUNTS["postgresql"])


def _after(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    import redis
    from django.conf import settings

    redis_before, pg_before = _started.pop(str(task_id), (0, 0))
    line = f"{task.name}|{COUNTS['redis'] - redis_before}|{COUNTS['postgresql'] - pg_before}"
    tag = os.environ["EXPLICIT_TEST_COUNT_ROUND_TRIPS"]
    redis.Redis.from_url(settings.REDIS_URL).rpush(f"round-trips:{tag}", line)
