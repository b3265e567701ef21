"""The relay's batch in three round trips (``django_outbox.db.libpq``) on real
PostgreSQL: BEGIN with the claim, COMMIT with the marks. Either path publishes, marks
and commits the same; a failing mark commits nothing; Django's transaction stays in
charge (``on_commit`` hooks, a transaction marked for rollback)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction
from django.test import override_settings

from django_outbox.db import libpq, relay_sql
from django_outbox.models import OutboxEvent, OutboxStatus
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.claim import CLAIM_POSTGRESQL, run_claim
from django_outbox.outbox.relay.loop import Relay
from tests.support.queues import queued

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def trips_used(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the relay went through ``RoundTrips`` (the real calls still run)."""
    used: Counter[str] = Counter()
    for name in ("run_all", "commit_with"):
        real = getattr(libpq.RoundTrips, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            used[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(libpq.RoundTrips, name, counted)
    return used


def write(queue: str, n: int) -> list[str]:
    with transaction.atomic():
        return [
            publish_event("tests.note", {"name": f"n{i}"}, options={"queue": queue})
            for i in range(n)
        ]


@pytest.mark.parametrize("fast", [True, False], ids=["round-trips", "django-cursor"])
def test_a_batch_publishes_marks_and_commits_on_either_path(
    fast: bool, queue: str, redis_client: Any, trips_used: Counter[str]
) -> None:
    ids = write(queue, 5)
    with override_settings(EXPLICIT_OUTBOX_RELAY_ROUND_TRIPS=fast):
        result = Relay(batch_size=3).drain()
    assert (result.published, result.failed) == (5, 0)
    assert [m["id"] for m in queued(redis_client, queue)] == ids
    rows = OutboxEvent.objects.filter(event_id__in=ids)
    assert {(r.status, r.attempts, r.published_at is not None) for r in rows} == {
        (OutboxStatus.PUBLISHED, 1, True)
    }
    # Two batches of events and an empty claim; a commit with the marks for each batch.
    expected = {"run_all": 3, "commit_with": 2} if fast else {}
    assert dict(trips_used) == expected


def test_the_claim_reads_the_same_rows_through_libpq_as_through_the_cursor(queue: str) -> None:
    OutboxEvent.objects.create(
        task_name="tests.note",
        args=[1, "ü'\\", None],
        kwargs={"name": "naïve", "nested": {"list": [1.5, True]}},
        headers={"idempotency_key": "k:1"},
        options={"queue": queue},
        ordering_key="order:1",
    )
    write(queue, 2)
    claimed = {}
    for fast in (True, False):
        with override_settings(EXPLICIT_OUTBOX_RELAY_ROUND_TRIPS=fast), transaction.atomic():
            claimed[fast] = run_claim("default", CLAIM_POSTGRESQL, 10)
            transaction.set_rollback(True)
    assert len(claimed[True]) == 3
    assert claimed[True] == claimed[False]
    assert claimed[True][0].created_at.tzinfo is not None


def test_a_failing_mark_commits_nothing_and_leaves_the_events_pending(
    queue: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch, trips_used: Counter[str]
) -> None:
    ids = write(queue, 2)
    monkeypatch.setattr(relay_sql, "MARK", relay_sql.MARK + " AND no_such_column")
    with pytest.raises(DatabaseError, match="no_such_column"):
        Relay().relay_batch()
    assert trips_used["commit_with"] == 1
    # Sent, not marked: at least once; the next batch publishes them again.
    assert [m["id"] for m in queued(redis_client, queue)] == ids
    assert set(OutboxEvent.objects.values_list("status", "attempts")) == {(OutboxStatus.PENDING, 0)}
    monkeypatch.undo()
    assert Relay().drain().published == 2


def test_a_commit_with_the_last_statements_still_runs_on_commit_hooks() -> None:
    ran: list[str] = []
    with transaction.atomic():
        transaction.on_commit(lambda: ran.append("hook"))
        OutboxEvent.objects.create(task_name="tests.note", kwargs={"name": "a"})
        trips = libpq.for_commit(connection, True)
        assert trips is not None
        trips.commit_with(
            [f"UPDATE {OutboxEvent._meta.db_table} SET attempts = 7"], what="the test's transaction"
        )
        assert ran == []  # Django's commit, at the end of the block, runs them
    assert ran == ["hook"]
    assert OutboxEvent.objects.get().attempts == 7


def test_the_fast_path_stands_aside_where_it_would_change_the_transaction() -> None:
    with transaction.atomic():
        assert libpq.for_new_transaction(connection, True) is not None
        assert libpq.for_new_transaction(connection, False) is None
        # Not begun on the server yet: nothing to commit with.
        assert libpq.for_commit(connection, True) is None
        OutboxEvent.objects.count()
        # Begun: the claim's BEGIN is no longer ours to send.
        assert libpq.for_new_transaction(connection, True) is None
        assert libpq.for_commit(connection, True) is not None
        # Django will roll back: we must not commit it.
        transaction.set_rollback(True)
        assert libpq.for_commit(connection, True) is None
    raw = connection.connection
    raw.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    try:
        with transaction.atomic():
            # psycopg would BEGIN ISOLATION LEVEL SERIALIZABLE; a bare BEGIN would not.
            assert libpq.for_new_transaction(connection, True) is None
    finally:
        raw.isolation_level = None
    # Autocommit: no transaction to begin.
    assert libpq.for_new_transaction(connection, True) is None
