"""The same one-row update, as a plain acks_late Celery task and as an ExplicitTask."""

from __future__ import annotations

import os
from typing import Any

from celery.worker.request import Request
from django.db import transaction
from django.db.models import F

from bench.benchapp.models import Row
from bench.celery_app import app
from celery_explicit import ExplicitTask, RateLimit


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


class CancellableUpdate(ExplicitUpdate):
    """ExplicitUpdate declaring ``cancellable``: its cost is the cancellation's
    (``bench/feature_cost.py``)."""

    name = "bench.cancellable_update"
    cancellable = True


app.register_task(CancellableUpdate())


class RateLimitedUpdate(ExplicitUpdate):
    """ExplicitUpdate under a keyed rate limit it never reaches: its cost is the
    admission's (``bench/feature_cost.py``)."""

    name = "bench.rate_limited_update"
    rate_limit = RateLimit("bench-row:{row_id}", 1_000_000, per=1.0)


app.register_task(RateLimitedUpdate())


class LimitedCall(ExplicitTask):
    """A call to an API that allows ``EXPLICIT_BENCH_RATE`` calls a second per account:
    each start written down on the Redis server's clock (``bench/rate_limit.py``)."""

    name = "bench.limited_call"
    idempotency_key = "bench-call:{run_id}:{job}"
    rate_limit = RateLimit("bench-api:{account}", int(os.environ.get("EXPLICIT_BENCH_RATE", "50")))
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, account: str, job: int, run_id: str) -> None:
        from celery_explicit import redis_state

        client = redis_state.client()
        seconds, micros = client.time()
        client.rpush(f"bench-starts:{run_id}", f"{account}|{seconds * 1000 + micros // 1000}")


app.register_task(LimitedCall())


@app.task(name="bench.noop", acks_late=True)
def noop(row_id: int, op_id: str) -> None:
    """Baseline: Celery's own cost per task on this machine."""


# --- the floor: what the contract must send, with none of our Python around it -------
# The statements ExplicitUpdate's job sends from its pool child, on the wire as it
# sends them (read off PostgreSQL's log_statement and Redis's MONITOR), built by hand
# with f-strings (not through our code; the values are the bench's own ids
# and ISO timestamps, which need no escaping):
# - the execution lease's two functions (FCALL acquire: the lease, its held-marker and
#   the fence counter; FCALL release), with the same keys and arguments;
# - BEGIN + the ledger claim (a 64-character fingerprint, a literal timestamp) + the
#   read of the stored row, in one string;
# - the same ORM update;
# - the attempt row with all its columns + the fence check + COMMIT, in one string.
# The lease functions are our Lua on the server: what the contract needs Redis to do
# atomically. The library is loaded once, before the first job, not per job (Redis 7
# functions: unlike our code, the floor has no EVALSHA fallback for Redis 6). Not
# sent: the message's visibility lease (the worker's main process, about 0.2 scripts
# a job). P1a against this task says how much our Python adds to the statements.
# EXPLICIT_EXECUTION_LEASE=0 drops the lease's round trips and the fence check here as
# it drops them in the ExplicitTask.
_floor_redis: Any = None
_floor_functions: tuple[str, str, str] = ("", "", "")
_FLOOR_LEASED = os.environ.get("EXPLICIT_EXECUTION_LEASE", "1") not in ("0", "false", "off")
#: Stands for the SHA-256 of the call's arguments: a value of the same length.
_FLOOR_FINGERPRINT = "f" * 64


def _floor_lease_client() -> Any:
    """The floor's Redis client, with our function library loaded (once)."""
    global _floor_redis, _floor_functions
    if _floor_redis is None:
        import redis
        from django.conf import settings

        from celery_explicit import redis_state
        from celery_explicit.redis_scripts import library

        client = redis.Redis.from_url(settings.REDIS_URL)
        lib = library()
        client.execute_command("FUNCTION", "LOAD", "REPLACE", lib.code)
        names = lib.function_names
        _floor_functions = (
            redis_state.prefix(),
            names["execution_lease_acquire"],
            names["execution_lease_release"],
        )
        _floor_redis = client
    return _floor_redis


@app.task(name="bench.floor_update", acks_late=True, bind=True)
def floor_update(self: Any, row_id: int, op_id: str) -> None:
    _floor(self.request.id, row_id, op_id, leased=_FLOOR_LEASED)


@app.task(name="bench.floor_update_unleased", acks_late=True, bind=True)
def floor_update_unleased(self: Any, row_id: int, op_id: str) -> None:
    """The floor without the execution lease's two Redis round trips and the fence
    check: what a job would cost with no Redis call from the pool process at all, the
    most that moving the lease out of the pool process could buy."""
    _floor(self.request.id, row_id, op_id, leased=False)


class MainLeaseRequest(Request):
    """The floor's request with the execution lease taken and given back by the worker's
    main process: taken as the job goes to the pool (one blocking call in the main
    process's loop), its fence handed to the pool child in the request, given back just
    before the ack. What moving the lease out of the pool process would buy, or cost."""

    @property
    def request_dict(self) -> dict[str, Any]:
        # Celery's worker reads this once, as it hands the job to the pool.
        headers: dict[str, Any] = self._request_dict
        if "floor_fence" not in headers:
            client = _floor_lease_client()
            prefix, acquire, _release = _floor_functions
            keys = _floor_keys(prefix, self.id)
            owner = f"bench:{os.getpid()}"
            reply = client.execute_command("FCALL", acquire, 3, *keys, 30_000, owner, 86_400, "")
            headers["floor_fence"] = int(reply[0])
        return headers

    def acknowledge(self) -> None:
        fence = self._request_dict.get("floor_fence")
        if fence and not self.acknowledged:
            client = _floor_lease_client()
            prefix, _acquire, release = _floor_functions
            keys = _floor_keys(prefix, self.id)
            released = client.execute_command("FCALL", release, 3, *keys, fence)
            if released != 1:  # logged as an error by the worker: check_workers stops
                raise RuntimeError(f"the floor's lease was not released: {released}")
        super().acknowledge()


def _floor_keys(prefix: str, task_id: str) -> tuple[str, str, str]:
    tag = "{" + task_id + "}"
    return f"{prefix}run:{tag}", f"{prefix}run-held:{tag}", f"{prefix}run-fence:{tag}"


@app.task(name="bench.floor_update_fenced", acks_late=True, bind=True)
def floor_update_fenced(self: Any, row_id: int, op_id: str) -> None:
    """The floor with its fence check at commit and no lease call from any process:
    what a lease carried inside writes the worker makes anyway (the delivery's script
    and the ack's, on the broker's Redis) could at most read, since it would add
    those scripts' work but no round trip."""
    _floor(self.request.id, row_id, op_id, leased=False, main_fence=1)


@app.task(name="bench.floor_update_main_lease", acks_late=True, bind=True, Request=MainLeaseRequest)
def floor_update_main_lease(self: Any, row_id: int, op_id: str) -> None:
    """The floor with its execution lease taken and released by the worker's main
    process (``MainLeaseRequest``): no Redis call from the pool process, the fence
    check at commit as under a lease."""
    fence = int(self.request.floor_fence)
    assert fence, "the floor's lease was taken"
    _floor(self.request.id, row_id, op_id, leased=False, main_fence=fence)


def _floor(
    task_id: str, row_id: int, op_id: str, *, leased: bool, main_fence: int | None = None
) -> None:
    from datetime import UTC, datetime

    from django.db import connection

    name = "bench.floor_update"  # the same statements, byte for byte, either way
    owner = f"bench:{os.getpid()}"
    fence = main_fence or 1
    if leased:
        client = _floor_lease_client()
        prefix, acquire, release = _floor_functions
        lease, held, counter = _floor_keys(prefix, task_id)
        fence = client.execute_command(
            "FCALL", acquire, 3, lease, held, counter, 30_000, owner, 86_400, "",
        )[0]  # fmt: skip
        assert fence, "the floor's lease was taken"
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    key = f"bench:{op_id}"
    started = datetime.now(UTC).isoformat()
    with transaction.atomic():
        pgconn.send_query(
            f"BEGIN; INSERT INTO django_outbox_processed_operation (key, task_name, task_id, "
            f"fingerprint, result_ref, processed_at, app_version) VALUES ('{key}', '{name}', "
            f"'{task_id}', '{_FLOOR_FINGERPRINT}', '', '{started}'::timestamptz, '') "
            "ON CONFLICT (key) DO NOTHING RETURNING key; "
            "SELECT fingerprint, result_ref FROM django_outbox_processed_operation "
            f"WHERE key = '{key}'".encode()
        )
        results = []
        while (result := pgconn.get_result()) is not None:
            results.append(result)
        # BEGIN, the claim, the read: a fresh key, so the claim won.
        assert results[1].ntuples == 1, results[1].error_message
        Row.objects.filter(id=row_id).update(value=F("value") + 1)
        finished = datetime.now(UTC).isoformat()
        last = (
            "INSERT INTO django_outbox_attempt (task_id, task_name, idempotency_key, attempt, "
            "redelivered, worker_host, worker_pid, started_at, finished_at, duration_ms, "
            "outcome, error_class, error_message, retry_delay, next_attempt_at, "
            "correlation_id, external_request_id, replay_of, published_via, deferrals, "
            "published_key, sent_at, app_version) "
            f"VALUES ('{task_id}', '{name}', '{key}', 1, false, 'bench', "
            f"{os.getpid()}, '{started}'::timestamptz, '{finished}'::timestamptz, 0.5, "
            f"'applied', '', '', NULL, NULL, '{task_id}', '', NULL, '', NULL, '', "
            f"'{started}'::timestamptz, ''); "
        )
        if leased or main_fence:
            # The fence check effect() sends with the attempt row under a lease.
            last += (
                "SELECT CAST('explicit: stale fencing token ' || token AS integer) "
                f"FROM django_outbox_fence WHERE task_id = '{task_id}' AND token > {fence}; "
            )
        committed = pgconn.exec_((last + "COMMIT").encode())
        assert committed.command_status == b"COMMIT", committed.error_message
    if leased:
        released = client.execute_command("FCALL", release, 3, lease, held, counter, fence)
        assert released == 1, f"the floor's lease was not released: {released}"


@app.task(
    name="bench.limited_call_celery",
    acks_late=True,
    rate_limit=f"{int(os.environ.get('EXPLICIT_BENCH_RATE', '50'))}/s",
)
def limited_call_celery(account: str, job: int, run_id: str) -> None:
    """LimitedCall under Celery's own ``rate_limit``, which each worker keeps for itself."""
    from celery_explicit import redis_state

    client = redis_state.client()
    seconds, micros = client.time()
    client.rpush(f"bench-starts:{run_id}", f"{account}|{seconds * 1000 + micros // 1000}")
