"""Delivery limit: a handler that kills its own worker is dead-lettered, not looped."""

from __future__ import annotations

import uuid

import pytest

from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, Outcome
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment, KillsItsWorker, KillsItsWorkerUnlimited

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_poison_message_goes_to_dead_letters_after_max_deliveries(
    start_worker, queue, redis_client
) -> None:
    Counter.objects.create(name="after-poison")
    worker = start_worker()
    job = uuid.uuid4().hex[:8]
    KillsItsWorker().apply_async(args=[job], queue=queue)
    # The attempt row is written just after the dead letter commits: wait for it too.
    wait_for(lambda: Attempt.objects.exists(), timeout=60, what="the terminal attempt")
    letter = DeadLetter.objects.get()
    assert letter.reason == DeadLetterReason.DELIVERY_LIMIT
    assert "delivered 4 times, more than max_deliveries=3" in letter.error_message
    assert letter.attempts == 4  # its deliveries, not the one attempt row it never had
    assert redis_client.llen(f"ran:{job}") == 3  # three kills, the fourth not run
    assert list(Attempt.objects.values_list("outcome", flat=True)) == [Outcome.DELIVERY_LIMIT]
    # The worker survived and goes on consuming.
    Increment().apply_async(kwargs={"name": "after-poison", "op_id": "1"}, queue=queue)
    wait_for(lambda: Counter.objects.get(name="after-poison").value == 1, what="next job")
    assert worker.alive()


def test_negative_control_without_a_reachable_limit_the_poison_loops(
    start_worker, queue, redis_client
) -> None:
    start_worker()
    job = uuid.uuid4().hex[:8]
    KillsItsWorkerUnlimited().apply_async(args=[job], queue=queue)
    # Well past the limit the other test enforces, and still no dead letter.
    wait_for(
        lambda: redis_client.llen(f"ran:{job}") >= 6,
        timeout=60,
        what="the poison message delivered again and again",
    )
    assert not DeadLetter.objects.exists()
