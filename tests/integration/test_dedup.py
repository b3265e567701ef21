"""Explicit dedup on real Redis and workers: a second message with a known id is dropped."""

from __future__ import annotations

import time
import uuid

import pytest
from kombu import Connection

from celery_explicit import metrics
from django_outbox.models import Attempt, Outcome
from tests.celery_app import app
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import RecordEvent, ShortDedup

pytestmark = pytest.mark.django_db(transaction=True)


def dropped(stage: str, task: str = "tests.record_event") -> float:
    return metrics.dedup_dropped.labels(task, stage)._value.get()


def test_second_publish_inside_the_window_is_dropped(redis_client, queue) -> None:
    event = uuid.uuid4().hex
    before = dropped("publish")
    first = RecordEvent().apply_async(args=[event, "a"], queue=queue)
    second = RecordEvent().apply_async(args=[event, "a"], queue=queue)
    assert second.id == first.id  # the caller gets the first message's handle
    assert redis_client.llen(queue) == 1
    assert dropped("publish") == before + 1
    other = RecordEvent().apply_async(args=[uuid.uuid4().hex, "a"], queue=queue)
    assert other.id != first.id
    assert redis_client.llen(queue) == 2


def test_after_the_window_the_same_id_publishes_again(redis_client, queue) -> None:
    event = uuid.uuid4().hex
    ShortDedup().apply_async(args=[event], queue=queue)
    ShortDedup().apply_async(args=[event], queue=queue)
    assert redis_client.llen(queue) == 1
    time.sleep(2.2)
    ShortDedup().apply_async(args=[event], queue=queue)
    assert redis_client.llen(queue) == 2


def test_a_failed_publish_gives_its_dedup_claim_back(redis_client, queue) -> None:
    event = uuid.uuid4().hex
    dead_broker = Connection("redis://127.0.0.1:1/0", connect_timeout=0.2)
    with pytest.raises(Exception):  # noqa: B017 - whatever the transport raises
        RecordEvent().apply_async(
            args=[event, "x"], queue=queue, connection=dead_broker, retry=False
        )
    RecordEvent().apply_async(args=[event, "x"], queue=queue)
    assert redis_client.llen(queue) == 1  # not dropped in favour of the lost message


@pytest.mark.worker
def test_a_resend_that_bypassed_publish_is_dropped_at_delivery(start_worker, queue) -> None:
    Counter.objects.create(name="ev")
    start_worker()
    event = uuid.uuid4().hex
    # Another service resends the event by task name: two messages, two task ids.
    ids = [
        app.send_task("tests.record_event", args=[event, "ev"], queue=queue).id for _ in range(2)
    ]
    wait_for(lambda: Attempt.objects.count() == 2, what="both deliveries handled")
    outcomes = dict(Attempt.objects.values_list("task_id", "outcome"))
    assert sorted(outcomes.values()) == [Outcome.APPLIED, Outcome.DEDUPLICATED]
    loser = next(i for i in ids if outcomes[i] == Outcome.DEDUPLICATED)
    winner = next(i for i in ids if i != loser)
    note = Attempt.objects.get(task_id=loser).error_message
    assert f"is owned by job {winner}" in note
    assert Counter.objects.get(name="ev").value == 1


@pytest.mark.worker
def test_a_retry_keeps_its_claim_and_is_not_dropped(start_worker, queue) -> None:
    Counter.objects.create(name="rt")
    start_worker()
    RecordEvent().apply_async(args=[uuid.uuid4().hex, "rt", True], queue=queue)
    wait_for(
        lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists(),
        what="applied after one retry",
    )
    assert [a.outcome for a in Attempt.objects.order_by("attempt")] == [
        Outcome.RETRY_SCHEDULED,
        Outcome.APPLIED,
    ]
    assert Counter.objects.get(name="rt").value == 1
