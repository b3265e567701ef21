"""Reconciliation compares times on one clock: PostgreSQL's, with the relay's own clock
converted through its offset, measured once a pass; a queue's head counts as sent
after the job's message only ``CLOCK_MARGIN`` later than it.

On real PostgreSQL and Redis; no worker runs: what a worker would leave (an attempt row,
its retry's message) is written by the test. The relay's host clock is off by what the
test says (its ``time`` in the reconciler and in the queue reader), the way redis-py's
tests patch ``mod_time``; PostgreSQL's and the worker's clocks are the machine's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from django_outbox import broker_queues
from django_outbox.models import Attempt, OutboxEvent
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay import reconcile
from django_outbox.outbox.relay.loop import Relay
from django_outbox.outbox.relay.reconcile import Reconciler
from tests.celery_app import app
from tests.support.queues import queued
from tests.testapp.tasks import Increment

pytestmark = pytest.mark.django_db(transaction=True)

AFTER = 0.05


@pytest.fixture(autouse=True)
def emptied_afterwards(queue: str, redis_client) -> Iterator[None]:
    yield
    redis_client.delete(queue)


class HostClock:
    """``time`` as a host whose clock is ``skew`` seconds off sees it."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def time(self) -> float:
        return time.time() + self.skew

    def monotonic(self) -> float:
        return time.monotonic()


def received_and_retrying(queue: str, redis_client, *, due_in: float) -> tuple[str, dict]:
    """An outbox event a worker took, whose attempt 1 scheduled a retry due in
    ``due_in`` seconds (the worker's clock); its kwargs."""
    kwargs = {"name": "clock", "op_id": uuid.uuid4().hex}
    with transaction.atomic():
        event_id = publish_event("tests.increment", kwargs, options={"queue": queue})
    assert Relay(notify_channel="").drain().published == 1
    redis_client.delete(queue)
    now = timezone.now()
    Attempt.objects.create(
        task_id=event_id,
        task_name="tests.increment",
        attempt=1,
        outcome="retry_scheduled",
        started_at=now,
        finished_at=now,
        duration_ms=1.0,
        next_attempt_at=now + timedelta(seconds=due_in),
    )
    return event_id, kwargs


def reconciler() -> Reconciler:
    time.sleep(AFTER * 2)
    return Reconciler(app=app, using="default", after=AFTER, limit=3, horizon=86400)


@pytest.mark.parametrize(
    ("skew", "due_in", "republished"),
    [(1000.0, 600.0, 0), (-1000.0, -1.0, 1)],
    ids=["relay-ahead-retry-not-due", "relay-behind-retry-overdue"],
)
def test_whether_a_retry_is_overdue_does_not_depend_on_the_relays_clock(
    queue: str,
    redis_client,
    monkeypatch: pytest.MonkeyPatch,
    skew: float,
    due_in: float,
    republished: int,
) -> None:
    event_id, _ = received_and_retrying(queue, redis_client, due_in=due_in)
    relay_host = HostClock(skew)
    monkeypatch.setattr(reconcile, "time", relay_host)
    monkeypatch.setattr(broker_queues, "time", relay_host)
    done = reconciler().run_once()
    # Ahead: the retry is due in ten minutes on PostgreSQL's clock, not overdue.
    # Behind: it is overdue now, not in a quarter of an hour.
    assert (done.retrying, done.republished) == (1 - republished, republished)
    assert done.ids == ([event_id] if republished else [])


def test_a_retry_waiting_at_the_head_of_its_queue_holds_it(queue: str, redis_client) -> None:
    # The worker writes the attempt's row, then publishes its retry, a moment later on
    # the same clock: that message, still waiting, was sent after the attempt's end.
    event_id, kwargs = received_and_retrying(queue, redis_client, due_in=0.0)
    app.tasks[Increment.name].apply_async(kwargs=kwargs, task_id=event_id, queue=queue)
    assert [m["id"] for m in queued(redis_client, queue)] == [event_id]
    done = reconciler().run_once()
    assert (done.queued, done.republished, done.dead_lettered) == (1, 0, 0)
    assert OutboxEvent.objects.get(event_id=event_id).republished == 0
