"""A database that cannot be written is an outage, not a bad job
(``celery_explicit.database_outage``): the errors it is told by, taken from the real
server, and a job whose effect meets a read-only transaction, run by a real worker."""

from __future__ import annotations

import uuid

import pytest
from django.db import DatabaseError, connection, connections, transaction

from celery_explicit import database_outage
from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, Outcome
from tests.support.ports import free_port
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import BookStock


def raised(sql: str, *, setup: str = "") -> DatabaseError:
    """The error the server answers ``sql`` with, as Django raises it."""
    with pytest.raises(DatabaseError) as info, transaction.atomic(), connection.cursor() as cursor:
        if setup:
            cursor.execute(setup)
        cursor.execute(sql)
    return info.value


@pytest.mark.django_db(transaction=True)
def test_a_read_only_transaction_is_an_outage_and_a_statement_timeout_is_transient():
    read_only = raised(
        "UPDATE testapp_counter SET value = value + 1", setup="SET TRANSACTION READ ONLY"
    )
    assert database_outage.cause_of(read_only) == "read_only"
    assert not database_outage.transient(read_only)

    cancelled = raised("SELECT pg_sleep(1)", setup="SET LOCAL statement_timeout = 10")
    assert database_outage.cause_of(cancelled) is None
    assert database_outage.transient(cancelled)  # 57014: retried within max_attempts

    # A handler's own error raised from the database's is still the database's.
    class GatewayError(Exception):
        pass

    try:
        raise GatewayError("could not book") from read_only
    except GatewayError as wrapped:
        assert database_outage.cause_of(wrapped) == "read_only"

    # The job's own mistakes are not outages.
    bad_sql = raised("SELECT * FROM no_such_table_here")
    assert database_outage.cause_of(bad_sql) is None
    assert not database_outage.transient(bad_sql)
    assert database_outage.cause_of(ValueError("no")) is None


@pytest.mark.django_db(transaction=True)
def test_a_refused_connection_is_an_outage_and_the_probe_says_so(settings):
    from django.db.backends.postgresql.base import DatabaseWrapper

    # The same database on a port nothing listens on: a server that is down.
    connections["away"] = DatabaseWrapper(
        {**connection.settings_dict, "PORT": str(free_port())}, alias="away"
    )
    settings.EXPLICIT_DATABASE = "away"
    try:
        with pytest.raises(DatabaseError) as info:
            connections["away"].ensure_connection()
        assert database_outage.cause_of(info.value) == "connection"
        assert database_outage.probe() == "connection"
    finally:
        connections["away"].close()
        del connections["away"]
    settings.EXPLICIT_DATABASE = "default"
    assert database_outage.probe() is None  # and the suspicion is lifted
    assert not database_outage.suspected()


@pytest.mark.parametrize("deferrals", [1, 2, 3, 6, 20])
def test_the_outage_backoff_doubles_from_one_second_up_to_its_cap(deferrals, settings):
    settings.EXPLICIT_DATABASE_OUTAGE_BACKOFF_CAP = 10.0
    ceiling = min(10.0, 2.0 ** (deferrals - 1))
    delays = [database_outage.backoff(deferrals) for _ in range(200)]
    assert ceiling / 2 <= min(delays) and max(delays) <= ceiling


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_read_only_database_defers_the_job_with_its_attempts_intact(start_worker, queue):
    """Twice the effect meets a read-only transaction: the job is deferred twice, then
    applied once at attempt 1 (of 2). Negative control, same job with the switch off:
    the unclassified error dead-letters it at once."""
    ref = f"ro-{uuid.uuid4().hex[:8]}"
    Counter.objects.create(name=ref)
    start_worker()
    BookStock().apply_async(kwargs={"ref": ref, "read_only_first": 2}, queue=queue)
    wait_for(
        lambda: Attempt.objects.filter(idempotency_key=f"stock:{ref}", outcome="applied").exists(),
        timeout=30,
        what="the job applied after two deferrals",
    )
    rows = list(Attempt.objects.filter(idempotency_key=f"stock:{ref}").order_by("started_at"))
    assert [a.outcome for a in rows] == [
        Outcome.DATABASE_UNAVAILABLE,
        Outcome.DATABASE_UNAVAILABLE,
        Outcome.APPLIED,
    ]
    assert [a.attempt for a in rows] == [1, 1, 1]  # no attempt spent on the outage
    assert rows[0].error_class.endswith("InternalError") and rows[0].retry_delay is not None
    assert 0.5 <= rows[0].retry_delay <= 1.0 and 1.0 <= rows[1].retry_delay <= 2.0
    assert rows[2].deferrals == {"database": 2}
    assert Counter.objects.get(name=ref).value == 1
    assert not DeadLetter.objects.exists()

    control = f"ro-off-{uuid.uuid4().hex[:8]}"
    Counter.objects.create(name=control)
    start_worker(queue=f"{queue}-off", extra_env={"EXPLICIT_DATABASE_OUTAGE": "0"})
    BookStock().apply_async(kwargs={"ref": control, "read_only_first": 2}, queue=f"{queue}-off")
    wait_for(
        lambda: DeadLetter.objects.filter(idempotency_key=f"stock:{control}").exists(),
        timeout=30,
        what="the control's dead letter",
    )
    letter = DeadLetter.objects.get(idempotency_key=f"stock:{control}")
    assert letter.reason == DeadLetterReason.UNCLASSIFIED
    assert Counter.objects.get(name=control).value == 0


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_dead_letter_that_cannot_be_written_waits_with_the_jobs_attempts(start_worker, queue):
    """The job fails for good while its session is read-only: its dead letter cannot be
    written, so the message is kept and deferred; once the database takes writes, the
    dead letter is written at attempt 1. Control, switch off: the failed write is
    retried as an attempt, and the dead letter says 2."""
    kept, control = (f"dl-{uuid.uuid4().hex[:8]}" for _ in range(2))
    start_worker()
    start_worker(queue=f"{queue}-off", extra_env={"EXPLICIT_DATABASE_OUTAGE": "0"})
    for ref, on in ((kept, queue), (control, f"{queue}-off")):
        BookStock().apply_async(kwargs={"ref": ref, "read_only_first": 1, "fail": True}, queue=on)
    wait_for(
        lambda: (
            DeadLetter.objects.filter(
                idempotency_key__in=[f"stock:{kept}", f"stock:{control}"]
            ).count()
            == 2
        ),
        timeout=40,
        what="both dead letters",
    )
    letter = DeadLetter.objects.get(idempotency_key=f"stock:{kept}")
    assert letter.reason == DeadLetterReason.UNCLASSIFIED and letter.attempts == 1
    (row,) = Attempt.objects.filter(idempotency_key=f"stock:{kept}")
    assert row.outcome == Outcome.FAILED_UNCLASSIFIED and row.attempt == 1
    assert row.deferrals == {"database": 1}
    assert DeadLetter.objects.get(idempotency_key=f"stock:{control}").attempts == 2
