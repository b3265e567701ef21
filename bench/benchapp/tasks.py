"""The same one-row update, as a plain acks_late Celery task and as an ExplicitTask."""

from __future__ import annotations

import os
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
# in one string: the statements ExplicitUpdate's job sends, built by hand with
# f-strings (issue 13: "not through our code"; the values are the bench's own hex ids,
# which need no escaping). Not sent: the message's visibility lease (the worker's main
# process, about 0.2 scripts a job), and the fence counter's INCR inside the lease's
# acquire. P1a against this task says how much our Python adds to the statements.
# EXPLICIT_EXECUTION_LEASE=0 drops the two Redis round trips here as it drops the lease.
_floor_redis: Any = None
_FLOOR_LEASED = os.environ.get("EXPLICIT_EXECUTION_LEASE", "1") not in ("0", "false", "off")


@app.task(name="bench.floor_update", acks_late=True)
def floor_update(row_id: int, op_id: str) -> None:
    global _floor_redis
    import redis
    from django.conf import settings
    from django.db import connection

    if _floor_redis is None:
        _floor_redis = redis.Redis.from_url(settings.REDIS_URL)
    lease = f"bench:floor:{op_id}"
    if _FLOOR_LEASED:
        _floor_redis.set(lease, "holder", nx=True, px=30_000)
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    key = f"bench:{op_id}"
    with transaction.atomic():
        claimed = pgconn.exec_(
            f"BEGIN; INSERT INTO django_outbox_processed_operation (key, task_name, task_id, "
            f"fingerprint, result_ref, processed_at) VALUES ('{key}', 'bench.floor_update', "
            f"'{op_id}', 'f', '', now()) ON CONFLICT (key) DO NOTHING RETURNING key".encode()
        )
        assert claimed.ntuples == 1, claimed.error_message  # a fresh key: the claim won
        Row.objects.filter(id=row_id).update(value=F("value") + 1)
        last = (
            "INSERT INTO django_outbox_attempt (task_id, task_name, idempotency_key, attempt, "
            "redelivered, worker_host, worker_pid, started_at, finished_at, duration_ms, "
            "outcome, error_class, error_message, correlation_id, external_request_id) "
            f"VALUES ('{op_id}', 'bench.floor_update', '{key}', 1, false, 'bench', 1, now(), "
            f"now(), 0.5, 'applied', '', '', '{op_id}', ''); "
        )
        if _FLOOR_LEASED:
            # The fence check effect() sends with the attempt row under a lease.
            last += (
                "SELECT CAST('stale ' || token AS integer) FROM django_outbox_fence "
                f"WHERE task_id = '{op_id}' AND token > 1; "
            )
        committed = pgconn.exec_((last + "COMMIT").encode())
        assert committed.command_status == b"COMMIT", committed.error_message
    if _FLOOR_LEASED:
        _floor_redis.delete(lease)
