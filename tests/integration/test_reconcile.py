"""Reconciliation on real PostgreSQL and Redis: an event published and then lost on the
broker's side (the queue emptied, as a broker restart between kombu's BRPOP and its
HSET leaves it) is published again; a received, running or still queued one is not.

No worker runs here: what a worker would leave (an attempt row, a lease) is written by
the test, and the broker's list is read directly.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from celery_explicit import execution_lease
from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, OutboxEvent, OutboxStatus
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.loop import Relay
from django_outbox.outbox.relay.reconcile import Reconciler
from tests.celery_app import app
from tests.support.queues import queued

pytestmark = pytest.mark.django_db(transaction=True)

AFTER = 0.05  # seconds: the test waits past it instead of back-dating rows


def publish(queue: str, op: str, **extra: object) -> str:
    with transaction.atomic():
        event_id = publish_event(
            "tests.increment", {"name": "c", "op_id": op}, options={"queue": queue}, **extra
        )
    assert Relay(notify_channel="").drain().published == 1
    return event_id


def reconciler(limit: int = 3) -> Reconciler:
    time.sleep(AFTER * 2)
    return Reconciler(app=app, using="default", after=AFTER, limit=limit, horizon=3600)


def test_a_lost_message_is_published_again_then_dead_lettered(queue, redis_client) -> None:
    event_id = publish(queue, "lost")
    # Still in its queue: the queue has not reached it, nothing is published again.
    done = reconciler().run_once()
    assert (done.looked_at, done.queued, done.republished) == (1, 1, 0)
    assert [m["id"] for m in queued(redis_client, queue)] == [event_id]

    for round_ in (1, 2, 3):
        redis_client.delete(queue)  # what a restart between BRPOP and HSET leaves
        done = reconciler().run_once()
        assert (done.republished, done.ids) == (1, [event_id]), round_
        message = queued(redis_client, queue)
        assert [m["id"] for m in message] == [event_id]  # the same job, same id
        assert message[0]["kwargs"] == {"name": "c", "op_id": "lost"}
        assert message[0]["headers"]["idempotency_key"] == "counter:c:op:lost"
        event = OutboxEvent.objects.get(event_id=event_id)
        assert (event.status, event.republished) == (OutboxStatus.PUBLISHED, round_)
        assert "no worker had received it" in event.last_error

    redis_client.delete(queue)
    done = reconciler(limit=3).run_once()
    assert (done.republished, done.dead_lettered) == (0, 1)
    assert redis_client.llen(queue) == 0
    letter = DeadLetter.objects.get(task_id=event_id)
    assert letter.reason == DeadLetterReason.NOT_RECEIVED
    assert "published 4 times, never received" in letter.error_message
    assert letter.kwargs == {"name": "c", "op_id": "lost"}
    assert OutboxEvent.objects.get(event_id=event_id).status == OutboxStatus.DEAD_LETTER


def test_a_received_job_is_marked_and_never_looked_at_again(queue, redis_client) -> None:
    event_id = publish(queue, "received")
    redis_client.delete(queue)
    now = timezone.now()
    Attempt.objects.create(
        task_id=event_id,
        task_name="tests.increment",
        attempt=1,
        outcome="applied",
        started_at=now,
        finished_at=now,
        duration_ms=1.0,
    )
    done = reconciler().run_once()
    assert (done.received, done.republished) == (1, 0)
    assert OutboxEvent.objects.get(event_id=event_id).checked_at is not None
    assert reconciler().run_once().looked_at == 0
    assert redis_client.llen(queue) == 0


def attempt_row(event_id: str, number: int, outcome: str, next_in: float | None = None) -> None:
    now = timezone.now()
    Attempt.objects.create(
        task_id=event_id,
        task_name="tests.increment",
        attempt=number,
        outcome=outcome,
        started_at=now,
        finished_at=now,
        duration_ms=1.0,
        next_attempt_at=now + timedelta(seconds=next_in) if next_in is not None else None,
    )


def test_a_job_is_followed_to_its_end_and_a_lost_retry_published_again(queue, redis_client) -> None:
    event_id = publish(queue, "retried")
    redis_client.delete(queue)  # a worker took it
    attempt_row(event_id, 1, "retry_scheduled", next_in=3600)
    done = reconciler().run_once()
    # Received, not ended, its retry not due yet: neither marked nor published again.
    assert (done.received, done.retrying, done.republished) == (0, 1, 0)
    assert OutboxEvent.objects.get(event_id=event_id).checked_at is None

    # The retry after attempt 2 was due and never came (lost with its broker).
    attempt_row(event_id, 2, "retry_scheduled", next_in=0)
    done = reconciler().run_once()
    assert (done.retrying, done.republished, done.ids) == (0, 1, [event_id])
    message = queued(redis_client, queue)
    assert [m["id"] for m in message] == [event_id]
    assert message[0]["headers"]["retries"] == 2  # the retry it stands for
    event = OutboxEvent.objects.get(event_id=event_id)
    assert "its retry after attempt 2 was" in event.last_error

    # It ran and ended: marked, never looked at again.
    redis_client.delete(queue)
    attempt_row(event_id, 3, "applied")
    assert reconciler().run_once().received == 1
    assert OutboxEvent.objects.get(event_id=event_id).checked_at is not None
    assert reconciler().run_once().looked_at == 0


def test_a_running_job_is_left_alone(queue, redis_client) -> None:
    event_id = publish(queue, "running")
    redis_client.delete(queue)  # a worker took it; its handler runs
    taken = execution_lease.acquire(event_id, ttl=30)
    assert isinstance(taken, execution_lease.Taken)
    try:
        done = reconciler().run_once()
        assert (done.in_flight, done.republished) == (1, 0)
    finally:
        execution_lease.release(event_id, taken.fence)
    assert reconciler().run_once().republished == 1  # the lease gone, no record: lost


def test_a_queue_with_older_messages_holds_it(queue, redis_client) -> None:
    older = publish(queue, "older")
    lost = publish(queue, "lost-behind")
    # Only the newer one vanished; the older still waits: the queue has not reached
    # the newer one's place, so nothing is published again yet.
    redis_client.lpop(queue)
    assert [m["id"] for m in queued(redis_client, queue)] == [older]
    done = reconciler().run_once()
    assert (done.queued, done.republished) == (2, 0)
    redis_client.delete(queue)
    done = reconciler().run_once()
    assert sorted(done.ids) == sorted([older, lost]) and done.republished == 2


def test_an_ordered_event_is_dead_lettered_not_published_out_of_order(queue, redis_client) -> None:
    event_id = publish(queue, "ordered", ordering_key="counter:c")
    redis_client.delete(queue)
    done = reconciler().run_once()
    assert (done.republished, done.dead_lettered) == (0, 1)
    letter = DeadLetter.objects.get(task_id=event_id)
    assert letter.reason == DeadLetterReason.NOT_RECEIVED
    assert "ordering key 'counter:c'" in letter.error_message


def test_a_plain_task_leaves_no_trace_and_is_not_published_again(queue, redis_client) -> None:
    with transaction.atomic():
        publish_event(
            "tests.increment_unguarded", {"name": "p", "op_id": "1"}, options={"queue": queue}
        )
    assert Relay(notify_channel="").drain().published == 1
    redis_client.delete(queue)
    done = reconciler().run_once()
    assert (done.looked_at, done.republished) == (1, 0)
    assert OutboxEvent.objects.get().checked_at is not None


def test_events_past_the_horizon_age_out_unlooked(queue, redis_client) -> None:
    publish(queue, "ancient")
    redis_client.delete(queue)
    OutboxEvent.objects.update(published_at=F("published_at") - timedelta(hours=2))
    done = reconciler().run_once()
    assert (done.aged_out, done.looked_at, done.republished) == (1, 0, 0)
