"""The same one-row update, as a plain acks_late Celery task and as an ExplicitTask."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F

from bench.benchapp.models import Row
from bench.celery_app import app
from celery_explicit import ExplicitTask


@app.task(name="bench.plain_update", acks_late=True)
def plain_update(row_id: int, op_id: str) -> None:
    with transaction.atomic():
        Row.objects.filter(id=row_id).update(value=F("value") + 1)


class ExplicitUpdate(ExplicitTask):
    name = "bench.explicit_update"
    idempotency_key = "bench:{op_id}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, row_id: int, op_id: str) -> None:
        with self.effect() as eff:
            if eff.done:
                return
            Row.objects.filter(id=row_id).update(value=F("value") + 1)


app.register_task(ExplicitUpdate())


@app.task(name="bench.noop", acks_late=True)
def noop(row_id: int, op_id: str) -> None:
    """Baseline: Celery's own cost per task on this machine."""


# --- the floor: what the contract must send, with none of our Python around it -------
# One SET NX PX and one DEL (the execution lease's two round trips), BEGIN + the ledger
# claim in one string, the same ORM update, the attempt row + the fence check + COMMIT
# in one string: the statements ExplicitUpdate's job sends, built by hand. Not sent: the
# message's visibility lease (the worker's main process, about 0.2 scripts a job), and
# the fence counter's INCR inside the lease's acquire. P1 against this task says how
# much of the gap is PostgreSQL's and Redis's work, which no code of ours can remove.
# EXPLICIT_EXECUTION_LEASE=0 drops the two Redis round trips here as it drops the lease.
_floor_redis: Any = None
_ATTEMPT_SQL = (
    "INSERT INTO django_outbox_attempt (task_id, task_name, idempotency_key, attempt, "
    "redelivered, worker_host, worker_pid, started_at, finished_at, duration_ms, outcome, "
    "error_class, error_message, correlation_id, external_request_id) VALUES "
    "({op}, 'bench.floor_update', {key}, 1, false, 'bench', 1, now(), now(), 0.5, "
    "'applied', '', '', {op}, '')"
)


@app.task(name="bench.floor_update", acks_late=True)
def floor_update(row_id: int, op_id: str) -> None:
    global _floor_redis
    import redis
    from django.conf import settings
    from django.db import connection
    from psycopg import sql

    from celery_explicit import execution_lease
    from django_outbox import ledger

    if _floor_redis is None:
        _floor_redis = redis.Redis.from_url(settings.REDIS_URL)
    leased = execution_lease.enabled()
    lease = f"bench:floor:{op_id}"
    if leased:
        _floor_redis.set(lease, "holder", nx=True, px=30_000)
    connection.ensure_connection()
    raw = connection.connection
    key = f"bench:{op_id}"
    claim = (
        sql.SQL(ledger._CLAIM_SQL.replace("%s", "{}"))
        .format(key, "bench.floor_update", op_id, "f", sql.SQL("now()"))
        .as_string(raw)
    )
    with transaction.atomic():
        claimed = raw.pgconn.exec_(f"BEGIN; {claim}".encode())
        assert claimed.ntuples == 1, claimed.error_message  # a fresh key: the claim won
        Row.objects.filter(id=row_id).update(value=F("value") + 1)
        last = [sql.SQL(_ATTEMPT_SQL).format(op=op_id, key=key).as_string(raw)]
        if leased:
            # The fence check effect() sends with the attempt row when the job holds
            # an execution lease.
            fence = sql.SQL(ledger._FENCE_CHECK_SQL.replace("%s", "{}")).format(op_id, 1)
            last.append(fence.as_string(raw))
        committed = raw.pgconn.exec_("; ".join([*last, "COMMIT"]).encode())
        assert committed.command_status == b"COMMIT", committed.error_message
    if leased:
        _floor_redis.delete(lease)
