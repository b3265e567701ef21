"""Reconciliation on RabbitMQ with a real worker: the jobs a busy worker holds prefetched
are alive, not lost.

A worker of concurrency 1 runs a slow job while it holds the queue's next three
messages prefetched (unacknowledged): the passive declare counts none of them, and
RabbitMQ keeps no per-message record reconciliation could read. Only the management
API's ``messages_unacknowledged`` says the queue still holds them. One of them has an
ordering key: taken for lost it would be dead-lettered, alive. The negative control is
the same scene with the unacknowledged gate off: those jobs are published again.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
from django.db import transaction
from kombu import Connection

from django_outbox import broker_queues
from django_outbox.models import DeadLetter, OutboxEvent
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay import reconcile
from django_outbox.outbox.relay.loop import Relay
from django_outbox.outbox.relay.reconcile import Reconciler
from tests.celery_app import app
from tests.conftest import RABBITMQ_URL
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]

AFTER = 0.5  # seconds: every job here is older than this when the pass runs
PREFETCHED = 3


@pytest.fixture
def rabbitmq_queue(queue: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The app (the relay and the reconciler here) on RabbitMQ; the queue is deleted
    afterwards."""
    monkeypatch.setitem(app.conf, "broker_url", RABBITMQ_URL)
    monkeypatch.setitem(app.conf, "broker_read_url", RABBITMQ_URL)
    yield queue
    with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):
        conn.channel().queue_delete(queue)


def figures(queue: str) -> tuple[int, int | None, int | None]:
    """Ready now (the passive declare), and unacknowledged and ready in the management
    API's last figures."""
    with Connection(RABBITMQ_URL) as conn:
        state = broker_queues.queue_state(conn, queue)
    return state.depth, state.unacked, state.reported_ready


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "negative-control"])
def test_jobs_prefetched_by_a_busy_worker_are_in_flight_not_lost(
    start_worker, rabbitmq_queue: str, redis_client, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    queue = rabbitmq_queue
    if not gated:
        monkeypatch.setattr(reconcile, "_workers_may_hold", lambda head: False)
    worker = start_worker(
        concurrency=1, prefetch_multiplier=4, extra_env={"EXPLICIT_TEST_BROKER_URL": RABBITMQ_URL}
    )
    op = uuid.uuid4().hex[:8]
    with transaction.atomic():
        slow = publish_event(
            "tests.holds_the_line",
            {"name": op, "op_id": op, "seconds": 60},
            options={"queue": queue},
        )
        waiting = [
            publish_event(
                "tests.increment", {"name": op, "op_id": f"{op}-{n}"}, options={"queue": queue}
            )
            for n in range(PREFETCHED - 1)
        ]
        ordered = publish_event(
            "tests.increment",
            {"name": op, "op_id": f"{op}-ordered"},
            options={"queue": queue},
            ordering_key=f"counter:{op}",
        )
    assert Relay(notify_channel="").drain().published == PREFETCHED + 1
    wait_for(
        lambda: redis_client.llen(f"started:{op}") >= 1,
        timeout=30,
        what="the slow job to start",
        on_timeout=lambda: worker.log()[-2000:],
    )
    # The management API's figures lag the broker by its statistics interval (5 s):
    # the pass runs once they show every message held, none ready.
    wait_for(
        lambda: figures(queue) == (0, PREFETCHED + 1, 0),
        timeout=30,
        what="the management API to show the prefetched messages",
        on_timeout=lambda: figures(queue),
    )
    time.sleep(AFTER)

    done = Reconciler(app=app, using="default", after=AFTER, limit=3, horizon=3600).run_once()

    assert redis_client.llen(f"spans:{op}") == 0, "the slow job ended before the pass"
    assert (done.looked_at, done.in_flight) == (PREFETCHED + 1, 1)  # the slow one runs
    if gated:
        assert (done.queued, done.republished, done.dead_lettered) == (PREFETCHED, 0, 0)
        assert OutboxEvent.objects.filter(republished__gt=0).count() == 0
        assert not DeadLetter.objects.exists()
    else:
        # Taken for lost: published again, and the ordered one dead-lettered, alive.
        assert (done.queued, done.republished, done.dead_lettered) == (0, PREFETCHED - 1, 1)
        assert sorted(done.ids) == sorted([*waiting, ordered])
        assert DeadLetter.objects.get().task_id == ordered
    assert slow not in done.ids
    worker.stop(signal.SIGKILL)  # the slow job need not finish
    redis_client.delete(f"started:{op}")
