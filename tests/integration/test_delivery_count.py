"""A redelivered job's delivery count is deleted when its handler ends, and kept when the
job goes on or never ran (the count is how a message that kills its worker is known)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import redis

from celery_explicit import redis_state
from celery_explicit.delivery_limit import DeliveryLimitStep, count_delivery, count_key
from celery_explicit.execution import Execution
from celery_explicit.steps import Ending


class Request:
    retries = 0


def counted(task_id: str) -> Execution:
    """The execution of a message redelivered twice (three deliveries)."""
    count_delivery(task_id, 0)
    deliveries = count_delivery(task_id, 0) + 1
    return Execution(
        task_id=task_id,
        task_name="tests.counted",
        key=f"k:{task_id}",
        fingerprint="",
        attempt=1,
        started_at=datetime.now(UTC),
        correlation_id="",
        deliveries=deliveries,
    )


@pytest.mark.parametrize(
    ("goes_on", "entered", "kept"),
    [(False, True, False), (True, True, True), (False, False, True)],
    ids=["ended", "control-goes-on", "control-never-ran"],
)
def test_the_count_of_a_job_that_ended_is_deleted(goes_on: bool, entered: bool, kept: bool) -> None:
    client: redis.Redis = redis_state.client()
    task_id = uuid.uuid4().hex
    execution = counted(task_id)
    assert execution.deliveries == 3
    step = DeliveryLimitStep("tests.counted", 5)
    step.after_run(Request(), execution, Ending(goes_on=goes_on), entered=entered)
    try:
        assert client.exists(count_key(task_id, 0)) == int(kept)
    finally:
        client.delete(count_key(task_id, 0))
