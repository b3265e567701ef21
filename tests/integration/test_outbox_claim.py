"""``claim_batch`` on real PostgreSQL, and the relay command leaving
the project's Celery app as it found it."""

from __future__ import annotations

import io
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_outbox.conf import settings
from django_outbox.models import OutboxEvent
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.claim import claim_batch
from tests.support.queues import queued

pytestmark = pytest.mark.django_db(transaction=True)


def event(name: str, key: str = "", **fields: object) -> str:
    row = OutboxEvent.objects.create(
        task_name="tests.note", kwargs={"name": name}, ordering_key=key, **fields
    )
    return str(row.event_id)


def test_the_claim_takes_the_oldest_pending_event_of_each_key_in_order() -> None:
    a1, a2 = event("a1", "a"), event("a2", "a")
    loose = event("loose")
    b1 = event("b1", "b")
    event("later", available_at=timezone.now() + timedelta(hours=1))
    event("done", status="dead_letter")
    with transaction.atomic():
        claimed = claim_batch("default", 10)
    assert [c.event_id for c in claimed] == [a1, loose, b1]
    assert [c.kwargs for c in claimed] == [{"name": "a1"}, {"name": "loose"}, {"name": "b1"}]
    with transaction.atomic():
        assert [c.event_id for c in claim_batch("default", 2)] == [a1, loose]
    # a2 waits for a1 to leave the pending state, whoever holds it.
    OutboxEvent.objects.filter(event_id=a1).update(status="dead_letter")
    with transaction.atomic():
        assert [c.event_id for c in claim_batch("default", 10)] == [a2, loose, b1]


def test_a_second_transaction_skips_the_rows_the_first_holds() -> None:
    first, second = event("first"), event("second")
    held = threading.Event()
    release = threading.Event()
    taken: list[str] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                taken.extend(c.event_id for c in claim_batch("default", 1))
                held.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(30)
        with transaction.atomic():
            # Not waiting for the lock, not returning the locked row: the next one.
            assert [c.event_id for c in claim_batch("default", 10)] == [second]
    finally:
        release.set()
        thread.join(30)
    assert taken == [first]


def test_the_claim_outside_a_transaction_is_refused() -> None:
    event("alone")
    with pytest.raises(TransactionManagementError, match=r"transaction\.atomic"):
        claim_batch("default", 10)


def test_the_relay_command_leaves_the_celery_app_settings_alone(queue, redis_client) -> None:
    app = settings.celery_app()
    app.finalize(auto=True)  # what the command does before publishing, Celery's own
    before = dict(app.conf.changes)
    with transaction.atomic():
        event_id = publish_event("tests.note", {"name": "conf"}, options={"queue": queue})
    call_command("explicit_relay", "--once", stdout=io.StringIO())
    assert [m["id"] for m in queued(redis_client, queue)] == [event_id]
    assert dict(app.conf.changes) == before
