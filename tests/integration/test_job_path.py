"""The job path end to end, with real worker processes, PostgreSQL and Redis."""

from __future__ import annotations

import pytest

from django_outbox.models import Attempt, DeadLetter, Outcome, ProcessedOperation
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment
from tests.workers import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_effect_applies_once_and_duplicate_publish_is_absorbed(start_worker, queue):
    Counter.objects.create(name="a")
    start_worker()
    for _ in range(3):
        Increment().apply_async(kwargs={"name": "a", "op_id": "1"}, queue=queue)
    wait_for(lambda: Attempt.objects.count() == 3, what="3 attempts")
    assert Counter.objects.get(name="a").value == 1
    outcomes = sorted(Attempt.objects.values_list("outcome", flat=True))
    assert outcomes == [Outcome.ALREADY_APPLIED, Outcome.ALREADY_APPLIED, Outcome.APPLIED]
    ledger = ProcessedOperation.objects.get()
    assert ledger.key == "counter:a:op:1"
    assert ledger.result_ref == "a+1"
    assert not DeadLetter.objects.exists()
