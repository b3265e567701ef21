"""A deferred job is alive, not lost: a deferral (``republish.defer``) writes no attempt
row, so it leaves a marker that reconciliation reads as in flight until
``RECONCILE_AFTER`` after its next message is due.

On real PostgreSQL and Redis, with the real ``defer`` called as the job path calls it;
no worker runs. The scene: the job was received, ran ten seconds, and deferred itself
for an hour (its entity's turn, a downstream's admission); its next message waits in
its queue, sent well after the event's publish, so the queue looks past the event.
The negative control defers without the marker: the live job is published again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from celery.exceptions import Ignore
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from celery_explicit import redis_scripts, redis_state, republish
from celery_explicit.execution import Execution
from celery_explicit.headers import PUBLISHED_VIA_HEADER
from django_outbox.models import OutboxEvent
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.loop import Relay
from django_outbox.outbox.relay.reconcile import Reconciler
from tests.celery_app import app
from tests.support.queues import queued
from tests.testapp.tasks import Increment

pytestmark = pytest.mark.django_db(transaction=True)

AFTER = 0.05  # the reconciler's; the marker's margin is the setting (default 300 s)
HOUR = 3600.0


@pytest.fixture
def deferred_job(queue: str, redis_client) -> Iterator[str]:
    """An outbox event received by a worker (its queue emptied), which ran ten seconds
    and is about to defer; its marker and queue are deleted afterwards."""
    with transaction.atomic():
        event_id = publish_event(
            "tests.increment", {"name": "d", "op_id": uuid.uuid4().hex}, options={"queue": queue}
        )
    assert Relay(notify_channel="").drain().published == 1
    redis_client.delete(queue)  # a worker took it
    OutboxEvent.objects.update(published_at=F("published_at") - timedelta(seconds=10))
    yield event_id
    redis_state.client().delete(republish.deferral_key(event_id))
    redis_client.delete(queue)


def defer_for_an_hour(event_id: str, queue: str, *, via: str = "outbox") -> None:
    """What the job path does when a step defers the job: ``republish.defer``."""
    task = app.tasks[Increment.name]
    task.push_request(
        id=event_id, retries=0, delivery_info={"routing_key": queue}, **{PUBLISHED_VIA_HEADER: via}
    )
    try:
        execution = Execution(
            task_id=event_id,
            task_name=task.name,
            key="counter:d:op:x",
            fingerprint="",
            attempt=1,
            started_at=timezone.now(),
            correlation_id="",
        )
        with pytest.raises(Ignore):
            republish.defer(task, execution, (), {}, HOUR, by="test")
    finally:
        task.pop_request()


def reconcile() -> Reconciler:
    time.sleep(AFTER * 2)
    return Reconciler(app=app, using="default", after=AFTER, limit=3, horizon=86400)


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "negative-control"])
def test_a_job_deferred_past_reconcile_after_is_in_flight_until_its_marker_runs_out(
    deferred_job: str, queue: str, redis_client, monkeypatch: pytest.MonkeyPatch, marked: bool
) -> None:
    event_id = deferred_job
    if not marked:
        monkeypatch.setattr(republish, "_mark_deferred", lambda execution, delay: None)
    defer_for_an_hour(event_id, queue)
    # Its next message waits in the queue, sent ten seconds after the event's publish.
    assert [m["id"] for m in queued(redis_client, queue)] == [event_id]

    done = reconcile().run_once()
    if not marked:
        # Without the marker the deferral left no trace: the live job is published again.
        assert (done.in_flight, done.republished, done.ids) == (0, 1, [event_id])
        return
    assert (done.looked_at, done.in_flight, done.republished, done.dead_lettered) == (1, 1, 0, 0)
    assert OutboxEvent.objects.get(event_id=event_id).checked_at is None  # looked at again

    # The marker: due in an hour on the server's clock, gone RECONCILE_AFTER after that.
    client = redis_state.client()
    key = republish.deferral_key(event_id)
    server_now_ms = redis_scripts.server_time(client) * 1000
    assert abs(int(client.get(key)) - (server_now_ms + HOUR * 1000)) < 5000
    margin = 300.0  # EXPLICIT_OUTBOX_RECONCILE_AFTER's default
    assert HOUR + margin - 5 <= client.pttl(key) / 1000 <= HOUR + margin

    # The hour and the margin pass (the key runs out) and its message never came (lost
    # with its broker): published again.
    client.pexpire(key, 1)
    time.sleep(0.01)
    redis_client.delete(queue)
    done = reconcile().run_once()
    assert (done.in_flight, done.republished, done.ids) == (0, 1, [event_id])


def test_a_deferral_writes_no_marker_for_a_job_not_from_the_outbox(
    deferred_job: str, queue: str
) -> None:
    # Only outbox events are reconciled: a job published otherwise costs no command.
    defer_for_an_hour(deferred_job, queue, via="direct")
    assert not redis_state.client().exists(republish.deferral_key(deferred_job))


def test_with_reconciliation_off_a_deferral_writes_no_marker(
    deferred_job: str, queue: str, settings
) -> None:
    settings.EXPLICIT_OUTBOX_RECONCILE_AFTER = 0
    defer_for_an_hour(deferred_job, queue)
    assert not redis_state.client().exists(republish.deferral_key(deferred_job))
