"""The job path on both brokers: Redis and RabbitMQ, with real workers.

On RabbitMQ a message goes back to the queue when its channel closes (a killed worker),
not after a visibility timeout; the effect ledger and the delivery limit must hold the
same way.
"""

from __future__ import annotations

import uuid

import pytest
from kombu import Connection

from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, Outcome
from tests.celery_app import app
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment, KillsItsWorker

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def publish(task, broker: str, queue: str, **options):  # type: ignore[no-untyped-def]
    with Connection(broker) as conn:
        return task.apply_async(queue=queue, connection=conn, **options)


def test_crash_after_commit_is_redelivered_and_absorbed(start_worker, queue, broker) -> None:
    Counter.objects.create(name="k")
    start_worker(extra_env={"EXPLICIT_TEST_BROKER_URL": broker})
    publish(
        Increment(), broker, queue, kwargs={"name": "k", "op_id": "1", "die_after_effect": True}
    )
    wait_for(
        lambda: (
            sorted(Attempt.objects.values_list("outcome", flat=True))
            == [Outcome.ALREADY_APPLIED, Outcome.APPLIED]
        ),
        timeout=60,
        what="the redelivered execution",
    )
    assert Counter.objects.get(name="k").value == 1
    assert Attempt.objects.filter(outcome=Outcome.ALREADY_APPLIED, redelivered=True).exists()


def test_poison_message_hits_the_delivery_limit(start_worker, queue, broker, redis_client) -> None:
    start_worker(extra_env={"EXPLICIT_TEST_BROKER_URL": broker})
    job = uuid.uuid4().hex[:8]
    publish(KillsItsWorker(), broker, queue, args=[job])
    letter = wait_for(lambda: DeadLetter.objects.first(), timeout=60, what="the dead letter")
    assert letter.reason == DeadLetterReason.DELIVERY_LIMIT
    assert redis_client.llen(f"ran:{job}") == 3


def test_unknown_task_and_bad_arguments_are_dead_lettered(start_worker, queue, broker) -> None:
    Counter.objects.create(name="after")
    worker = start_worker(extra_env={"EXPLICIT_TEST_BROKER_URL": broker})
    with Connection(broker) as conn:
        unknown = app.send_task("shop.no_such_task", args=[1], queue=queue, connection=conn)
        wrong = app.send_task(
            "tests.increment", args=[1, 2, 3, 4, 5, 6], queue=queue, connection=conn
        )
    publish(Increment(), broker, queue, kwargs={"name": "after", "op_id": "1"})
    wait_for(lambda: DeadLetter.objects.count() == 2, timeout=30, what="two dead letters")
    wait_for(lambda: Counter.objects.get(name="after").value == 1, what="the good job")
    reasons = dict(DeadLetter.objects.values_list("task_id", "reason"))
    assert reasons == {
        unknown.id: DeadLetterReason.UNKNOWN_TASK,
        wrong.id: DeadLetterReason.BAD_INPUT,
    }
    assert worker.alive()
