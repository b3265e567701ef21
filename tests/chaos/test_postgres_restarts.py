"""PostgreSQL restarted (``pg_ctl -m immediate stop``, then start: a crash and its
recovery) at random intervals while jobs run: 2 restarts 3-6 s apart over 100 jobs
short, restarts 5-40 s apart over a few minutes and 1,000 jobs full.

The workers' database is a private cluster of the test's own (initdb in a temp dir, its
own port): the effect rows, the ledger, the attempts and the dead letters all live
there, so they crash and recover together. Must hold, from that cluster's history: 0
effects without their ledger row and 0 ledger rows without their effect; every job done
or dead-lettered with a reason. No negative control: the ledger commits in the
effect's own transaction, and there is no switch that takes it out while keeping the
job idempotent; the kill storm's control (test_kills.py) already shows a job without
the ledger applying twice.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection

from tests.chaos import history
from tests.chaos.report import Row, scaled
from tests.chaos.tasks_postgres import ChaosDbJob
from tests.support.private_postgres import PrivatePostgres
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    # 300 s at the short scale: it ran about a minute on a quiet machine, and a machine
    # twice as slow must not be cut off by the timeout; the full scale runs for minutes.
    pytest.mark.timeout(scaled(300, 900)),
]

JOBS = scaled(100, 1000)
RESTARTS = scaled(2, 6)
INTERVAL = (3.0, 6.0) if RESTARTS == 2 else (5.0, 40.0)  # seconds between restarts
HOLD = 0.1  # each job runs this long before its effect: restarts land mid-transaction
DB_NAME = "chaos_postgres"


class PrivateConnection:
    """``history``'s database connection, pointed at the private cluster: a fresh
    connection per cursor, so a restart between two reads costs nothing."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    @contextlib.contextmanager
    def cursor(self) -> Iterator[Any]:
        with psycopg.connect(self.dsn, autocommit=True) as conn, conn.cursor() as cursor:
            yield cursor


@pytest.fixture
def private_pg(monkeypatch: pytest.MonkeyPatch, queue: str) -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres(DB_NAME, prefix="chaos-postgres-")
    try:
        pg.init()
        pg.start()
        pg.create_project_database(queue)
        monkeypatch.setattr(history, "connection", PrivateConnection(pg.dsn))
        history.ensure_tables()
        yield pg
    finally:
        pg.destroy()


def query(pg: PrivatePostgres, sql: str, params: list[Any]) -> int:
    rows = pg.query(sql, params)
    return int(rows[0][0]) if rows else 0


def orphans(pg: PrivatePostgres, run: str) -> tuple[int, int]:
    """(effects without their ledger row, ledger rows without their effect) of ``run``."""
    effects_alone = query(
        pg,
        """
        SELECT count(DISTINCT e.job) FROM chaos_effect e
        LEFT JOIN django_outbox_processed_operation p ON p.key = 'chaos:' || e.run || ':' || e.job
        WHERE e.run = %s AND p.key IS NULL
        """,
        [run],
    )
    ledger_alone = query(
        pg,
        """
        SELECT count(*) FROM django_outbox_processed_operation p
        WHERE p.key LIKE %s AND NOT EXISTS (
            SELECT 1 FROM chaos_effect e
            WHERE e.run = %s AND 'chaos:' || e.run || ':' || e.job = p.key
        )
        """,
        [f"chaos:{run}:%", run],
    )
    return effects_alone, ledger_alone


def settled(run: str) -> bool:
    """Every job done or dead-lettered; False while the server is still coming back."""
    try:
        return history.check(run).lost == 0
    except psycopg.Error:
        return False


def test_postgres_restarts(start_worker, queue, run_id, private_pg) -> None:
    from django.conf import settings

    pg = private_pg
    started = time.monotonic()
    for _ in range(2):
        start_worker(concurrency=2, extra_env=pg.env())
    rng = random.Random(run_id)
    gaps = [rng.uniform(*INTERVAL) for _ in range(RESTARTS)]
    # Jobs go out at a steady pace over the restarts (each takes the server away for a
    # second or two) and a little after, so every restart lands on jobs in flight.
    span = sum(gaps) + RESTARTS * 3.0 + 2.0
    history.record_published(run_id, range(JOBS))

    def publish() -> None:
        with Connection(settings.CELERY_BROKER_URL) as conn:
            for job in range(JOBS):
                time.sleep(max(0.0, publish_start + job * span / JOBS - time.monotonic()))
                ChaosDbJob().apply_async(
                    kwargs={"run": run_id, "job": job, "hold": HOLD}, queue=queue, connection=conn
                )

    publish_start = time.monotonic()
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    downtimes = []
    for gap in gaps:
        time.sleep(gap)
        down = time.monotonic()
        pg.crash()
        pg.start()
        downtimes.append(time.monotonic() - down)
    last_restart = time.monotonic()
    # Where the pace put the last restart: jobs still to publish were still to run.
    published_after = max(0, JOBS - int((last_restart - publish_start) * JOBS / span))
    publisher.join()
    # Generous: a job that failed against the dead server waits out its backoff
    # (at most 4 s a time); a loaded machine is slow to run the rest.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: settled(run_id), timeout=120 + JOBS * HOLD, interval=0.5)
    recovered = time.monotonic() - last_restart
    time.sleep(2.0)  # let a late retry land before counting
    counts = history.check(run_id)
    effects_alone, ledger_alone = orphans(pg, run_id)
    without_reason = query(
        pg,
        "SELECT count(*) FROM django_outbox_dead_letter WHERE idempotency_key LIKE %s"
        " AND coalesce(reason, '') = ''",
        [f"chaos:{run_id}:%"],
    )
    # A failed attempt's own row is written while the server is down, so it is lost
    # (logged instead); the attempt that finally applies the effect carries its number.
    retried = query(
        pg,
        "SELECT count(DISTINCT idempotency_key) FROM django_outbox_attempt"
        " WHERE idempotency_key LIKE %s AND outcome = 'applied' AND attempt > 1",
        [f"chaos:{run_id}:%"],
    )
    row = Row(
        scenario="postgres restarts",
        fault=f"PostgreSQL crashed and restarted every {INTERVAL[0]:g}-{INTERVAL[1]:g} s",
        faults=len(downtimes),
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures={
            "effects without ledger entry": effects_alone,
            "ledger entries without effect": ledger_alone,
            "dead-lettered": counts.dead_lettered,
            "dead letters without reason": without_reason,
            "jobs applied on a retry": retried,
            "max downtime (s)": round(max(downtimes), 1),
            "published after last restart": published_after,
            "all settled after last restart (s)": round(recovered, 1),
        },
        holds=effects_alone == 0
        and ledger_alone == 0
        and counts.lost == 0
        and counts.duplicates == 0
        and without_reason == 0,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, row
