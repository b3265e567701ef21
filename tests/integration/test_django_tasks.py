"""django.tasks tasks on ExplicitBackend, run by a real Celery worker: a success, a
retry then a success, a dead letter; and the durable path's outbox row.

Django 6.1+ only (tests/conftest.py collects it there; the matrix's Django 6 sessions
run it).
"""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction
from django.tasks import TaskResultStatus

from django_outbox.models import Attempt, DeadLetter, OutboxEvent, Outcome
from tests.support.waiting import wait_for
from tests.testapp import django_tasks
from tests.testapp.models import Counter

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def outcomes(job_id: str) -> list[str]:
    return list(
        Attempt.objects.filter(task_id=job_id).order_by("id").values_list("outcome", flat=True)
    )


def test_a_django_task_succeeds_retries_and_dead_letters_on_a_worker(
    start_worker, queue: str
) -> None:
    name = f"dt-{uuid.uuid4().hex[:8]}"
    Counter.objects.create(name=name, value=0)
    with transaction.atomic():
        added = django_tasks.add_one.using(queue_name=queue).enqueue(name=name)
        retried = django_tasks.add_one_after_failures.using(queue_name=queue).enqueue(
            name=f"{name}-flaky", failures=1
        )
        refused = django_tasks.refuse.using(queue_name=queue).enqueue(name=name)
    Counter.objects.create(name=f"{name}-flaky", value=0)
    assert added.status == TaskResultStatus.READY and added.kwargs == {"name": name}

    start_worker(concurrency=1)
    wait_for(
        lambda: (
            outcomes(added.id) == [Outcome.APPLIED]
            and outcomes(retried.id)[-1:] == [Outcome.APPLIED]
            and outcomes(refused.id) == [Outcome.FAILED_PERMANENT]
        ),
        timeout=60,
        what="each job's final attempt",
    )
    assert outcomes(retried.id) == [Outcome.RETRY_SCHEDULED, Outcome.APPLIED]
    assert Counter.objects.get(name=name).value == 1
    assert Counter.objects.get(name=f"{name}-flaky").value == 1
    letter = DeadLetter.objects.get(task_id=refused.id)
    # The worker ran the ExplicitTask named after the function's module path.
    assert letter.task_name == django_tasks.refuse.module_path
    assert letter.error_class.endswith("ValueError") and letter.kwargs == {"name": name}


def test_a_durable_task_is_an_outbox_row_of_the_callers_transaction() -> None:
    name = f"dt-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        result = django_tasks.add_one_durably.enqueue(name=name)
    event = OutboxEvent.objects.get(event_id=result.id)
    assert event.task_name == django_tasks.add_one_durably.module_path
    assert event.kwargs == {"name": name}
    with pytest.raises(Exception, match="outside a transaction"):
        django_tasks.add_one_durably.enqueue(name=name)
