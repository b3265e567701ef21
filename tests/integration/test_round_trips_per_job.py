"""Round trips per job from a worker's pool process, to Redis and to PostgreSQL, counted
on the wire's clients (``tests/support/round_trips.py``) in a real worker: an
ExplicitTask's one-row update in its effect, beside a plain acks-late task doing the
same update in a transaction. The figures are what docs/performance.md states; a change
that adds a round trip fails here."""

from __future__ import annotations

import uuid

import pytest

from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment, increment_unguarded

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

JOBS = 4


def counted(start_worker, queue: str, redis_client, task, name: str) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:8]
    queue = f"{queue}-{tag}"  # a worker of its own
    start_worker(
        queue=queue,
        concurrency=1,
        extra_env={"EXPLICIT_TEST_COUNT_ROUND_TRIPS": tag, "PSYCOPG_IMPL": "python"},
    )
    for job in range(JOBS):
        task.apply_async(kwargs={"name": name, "op_id": f"op-{job}"}, queue=queue)
        wait_for(
            lambda job=job: redis_client.llen(f"round-trips:{tag}") > job,
            timeout=30,
            what=f"job {job} counted",
        )
    rows = [raw.decode().split("|") for raw in redis_client.lrange(f"round-trips:{tag}", 0, -1)]
    return [(int(r), int(p)) for _task, r, p in rows]


def test_round_trips_of_a_job_from_the_pool_process(start_worker, queue: str, redis_client) -> None:  # type: ignore[no-untyped-def]
    name = f"rt-{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    plain = counted(start_worker, queue, redis_client, increment_unguarded, name)
    ours = counted(start_worker, queue, redis_client, Increment(), name)
    assert Counter.objects.get(name=name).value == 2 * JOBS
    # A pool process's first job loads the Redis scripts and opens its connections:
    # the later ones are what every job costs.
    _first, *steady = ours
    # BEGIN, UPDATE, COMMIT, and Django's set_config('TimeZone') on the connection
    # Celery's Django fix-up opens for each job (CONN_MAX_AGE = 0 here).
    assert set(plain[1:]) == {(0, 4)}, plain
    # Redis: the execution lease taken and given back. PostgreSQL: no more than the
    # plain transaction's (BEGIN travels with the ledger's claim, the attempt row with
    # COMMIT: django_outbox.db.libpq).
    assert set(steady) == {(2, 4)}, ours
