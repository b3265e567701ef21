"""A database that goes read-only, then away, while jobs run: an outage, not bad jobs.

Two workers (``-c 2``) on a private PostgreSQL cluster run a steady stream of
``tests.book_stock`` jobs (unclassified errors permanent, two attempts at most). The
cluster turns read-only for a few seconds (``default_transaction_read_only``, as a
standby not yet promoted), then is stopped (``pg_ctl -m fast``) and started again.
Must hold: every job applied exactly once, none dead-lettered, none applied on a
second attempt (the outage spent none), and few handler starts beyond one per job (the
process defers while its probe fails, instead of running handlers that cannot commit).

Negative control, the same faults with ``EXPLICIT_DATABASE_OUTAGE=0`` (the task's
retry policy decides): jobs end dead-lettered or applied on a later attempt.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from tests.support.private_postgres import PrivatePostgres
from tests.support.waiting import wait_for
from tests.testapp.tasks import BookStock

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

JOBS = 40
SPAN = 16.0  # seconds over which the jobs are published
HOLD = 0.2  # each handler sleeps this long before its effect: faults land mid-job
# (seconds after the first publish) read-only from, read-only until, stopped from,
# started again at
READ_ONLY = (3.0, 7.0)
STOPPED = (9.0, 13.0)


@pytest.fixture
def private_pg(queue: str) -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres("fault_outage", prefix="ce-outage-pg-")
    try:
        pg.init()
        pg.start()
        pg.create_project_database(queue)
        yield pg
    finally:
        pg.destroy()


@dataclass
class Round:
    applied: int  # jobs whose effect row says 1
    twice: int  # jobs whose effect happened more than once
    dead_letters: int
    later_attempt: int  # jobs applied on an attempt after the first
    deferred: int  # applied jobs whose attempt row counts database deferrals
    extra_starts: int  # handler starts beyond one per job
    settled_after: float  # seconds from the restart to the last job ending


def settled(pg: PrivatePostgres, refs: list[str]) -> bool:
    try:
        rows = pg.query(
            "SELECT count(*) FROM testapp_counter WHERE name = ANY(%s) AND value > 0",
            [refs],
        )
        letters = pg.query(
            "SELECT count(*) FROM django_outbox_dead_letter WHERE idempotency_key = ANY(%s)",
            [[f"stock:{ref}" for ref in refs]],
        )
    except psycopg.Error:
        return False  # the server is still coming back
    return int(rows[0][0]) + int(letters[0][0]) >= len(refs)


def outage_round(
    pg: PrivatePostgres, start_worker: Any, redis_client: Any, queue: str, env: dict[str, str]
) -> Round:
    refs = [f"bk-{uuid.uuid4().hex[:8]}" for _ in range(JOBS)]
    pg.query(
        "INSERT INTO testapp_counter (name, value) SELECT unnest(%s::text[]), 0 RETURNING 1",
        [refs],
    )
    for _ in range(2):
        start_worker(queue=queue, concurrency=2, extra_env={**pg.env(), **env})

    def publish() -> None:
        for n, ref in enumerate(refs):
            time.sleep(max(0.0, begun + n * SPAN / JOBS - time.monotonic()))
            BookStock().apply_async(kwargs={"ref": ref, "hold": HOLD}, queue=queue)

    begun = time.monotonic()
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    steps = [
        (READ_ONLY[0], lambda: pg.read_only(True)),
        (READ_ONLY[1], lambda: pg.read_only(False)),
        (STOPPED[0], pg.stop),
        (STOPPED[1], pg.start),
    ]
    for at, act in steps:
        time.sleep(max(0.0, begun + at - time.monotonic()))
        act()
    restarted = time.monotonic()
    publisher.join()
    wait_for(lambda: settled(pg, refs), timeout=180, interval=0.5, what="every job ended")
    settled_after = time.monotonic() - restarted
    time.sleep(2.0)  # a late duplicate would land now
    keys = [f"stock:{ref}" for ref in refs]
    values = dict(pg.query("SELECT name, value FROM testapp_counter WHERE name = ANY(%s)", [refs]))
    applied_rows = pg.query(
        "SELECT idempotency_key, attempt, deferrals FROM django_outbox_attempt"
        " WHERE idempotency_key = ANY(%s) AND outcome = 'applied'",
        [keys],
    )
    letters = pg.query(
        "SELECT count(*) FROM django_outbox_dead_letter WHERE idempotency_key = ANY(%s)", [keys]
    )
    starts = sum(int(redis_client.get(f"test:starts:{ref}") or 0) for ref in refs)
    return Round(
        applied=sum(1 for ref in refs if values.get(ref) == 1),
        twice=sum(1 for ref in refs if (values.get(ref) or 0) > 1),
        dead_letters=int(letters[0][0]),
        later_attempt=len({key for key, attempt, _ in applied_rows if attempt > 1}),
        deferred=sum(1 for _, _, d in applied_rows if d and d.get("database")),
        extra_starts=starts - JOBS,
        settled_after=round(settled_after, 1),
    )


def test_a_database_outage_defers_jobs_and_spends_none_of_their_attempts(
    start_worker, queue, redis_client, private_pg
) -> None:
    kept = outage_round(private_pg, start_worker, redis_client, queue, {})
    control = outage_round(
        private_pg, start_worker, redis_client, f"{queue}-off", {"EXPLICIT_DATABASE_OUTAGE": "0"}
    )
    print(f"outage contract: {kept}\ncontrol (switch off): {control}")
    assert kept.applied == JOBS, kept
    assert kept.twice == 0 and kept.dead_letters == 0 and kept.later_attempt == 0, kept
    assert kept.deferred > 0, kept  # the faults did reach jobs
    # At most a handler per process per fault onset ran against the broken database
    # (4 processes; the read-only turn, its end racing a probe, the stop).
    assert kept.extra_starts <= 16, kept
    assert control.twice == 0, control  # the ledger holds either way
    assert control.dead_letters + control.later_attempt > 0, control
