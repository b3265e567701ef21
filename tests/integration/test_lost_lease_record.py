"""An execution lease whose record Redis lost: fenced all the same, and still the job's.

What a Redis failover loses is the lease's keys: the execution that held them still
runs, and nothing in Redis says it was taken over. Here the loss is made by deleting
the keys (the failover itself is ``tests/fault/test_failover_fencing.py``'s and the
kill storm's).

- A redelivered job that finds its lease free writes its token as a fence row, and the
  earlier execution's commit is refused as a takeover's would be. Control: the same
  scene on a first delivery (no redelivery flag): no fence row, the commit lands.
- The earlier execution, ending, finds its record gone: with no newer fence row the
  job is still its own (a retry it publishes is not dropped as a taken-over job's
  would be); with one, it lost the job to the newer execution.
"""

from __future__ import annotations

import datetime as dt
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_explicit import execution_lease
from celery_explicit.errors import LeaseLost
from celery_explicit.execution import Execution
from celery_explicit.execution_lease_step import ExecutionLeaseStep, give_back, hand_back
from celery_explicit.headers import FENCE_FREE_LEASE_HEADER, REDELIVERED_HEADER
from celery_explicit.steps import RUN, Job
from django_outbox.incident import timeline, verdict
from django_outbox.models import Fence, ProcessedOperation
from django_outbox.store import ledger

pytestmark = pytest.mark.django_db(transaction=True)


def delivered(task_id: str, *, redelivered: bool, header: str = "") -> Job:
    execution = Execution(
        task_id=task_id,
        task_name="tests.ship",
        key=f"ship:{task_id}",
        fingerprint="f",
        attempt=1,
        started_at=dt.datetime.now(dt.UTC),
        correlation_id="",
    )
    request = SimpleNamespace(
        id=task_id, retries=0, delivery_info={"redelivered": redelivered}, headers={}
    )
    if header:
        setattr(request, header, True)  # Celery hands a message's headers to the request
    return Job(task_name="tests.ship", request=request, execution=execution)


def lose_the_lease(client: redis.Redis, task_id: str) -> None:
    """What a failover of asynchronous replication drops: the lease and its marker."""
    client.delete(execution_lease.lease_key(task_id), execution_lease.marker_key(task_id))


def commit(job: Job, fence: int) -> str:
    key = job.execution.key
    try:
        with ledger.effect(
            key=key,
            fingerprint="f",
            task_name="tests.ship",
            task_id=job.execution.task_id,
            fence=fence,
        ):
            pass
    except LeaseLost:
        return "refused"
    return "committed"


@pytest.mark.parametrize(
    ("redelivered", "header"),
    [
        (True, ""),
        # A deferred copy of a redelivery, and a copy the reconciler published again.
        (False, REDELIVERED_HEADER),
        (False, FENCE_FREE_LEASE_HEADER),
        (False, ""),
    ],
    ids=["redelivery", "deferred-redelivery", "republished", "control-first"],
)
def test_an_earlier_execution_with_a_lost_record_cannot_commit(
    redis_client: redis.Redis, redelivered: bool, header: str
) -> None:
    task_id = uuid.uuid4().hex
    step = ExecutionLeaseStep("tests.ship", ttl=30.0)
    earlier = execution_lease.acquire(task_id, ttl=30.0, client=redis_client)
    assert isinstance(earlier, execution_lease.Taken)
    lose_the_lease(redis_client, task_id)

    job = delivered(task_id, redelivered=redelivered, header=header)
    fenced = redelivered or bool(header)
    assert step.before_run(job) is RUN
    newer = job.execution.fence
    assert newer is not None and newer > earlier.fence
    try:
        outcome = commit(job, earlier.fence)
    finally:
        execution_lease.release(task_id, newer, client=redis_client)
    if fenced:
        fence = Fence.objects.get(task_id=task_id)
        assert (fence.token, fence.cause, fence.taken_over_from) == (newer, "unleased", "")
        assert outcome == "refused"
        assert not ProcessedOperation.objects.filter(key=job.execution.key).exists()
        assert commit(job, newer) == "committed"  # the redelivered execution's own
    else:
        assert not Fence.objects.filter(task_id=task_id).exists()
        assert outcome == "committed"  # what the fence is for


def test_a_redelivery_fence_raises_the_token_and_keeps_a_takeover_it_follows(db: Any) -> None:
    task_id = uuid.uuid4().hex
    ledger.record_takeover(task_id, "k", 7, "host:11", cause="holder_dead")
    ledger.record_fence(task_id, "k", 9)
    ledger.record_fence(task_id, "k", 8)  # late and older: no effect
    fence = Fence.objects.get(task_id=task_id)
    assert (fence.token, fence.taken_over_from, fence.cause) == (9, "host:11", "holder_dead")


def test_explain_counts_no_execution_for_a_redelivery_fence(db: Any) -> None:
    task_id = uuid.uuid4().hex
    ledger.record_fence(task_id, "k", 5)
    fences = list(Fence.objects.filter(task_id=task_id))
    assert verdict.unrecorded(fences, []) == []
    said = verdict.verdict([], None, [], fences)
    assert "never ran" in said and "takeover" not in said, said
    event = timeline.fence_event(fences[0], [])
    assert event.kind == "fence" and "its execution lease free" in event.text
    # A takeover is still an execution known from its fence row alone.
    ledger.record_takeover(task_id, "k", 6, "host:12", cause="holder_dead")
    fences = list(Fence.objects.filter(task_id=task_id))
    assert [f.taken_over_from for f in verdict.unrecorded(fences, [])] == ["host:12"]


@pytest.mark.parametrize("newer", [False, True], ids=["record-lost", "taken-over-and-ended"])
def test_an_execution_whose_record_is_gone_keeps_the_job_unless_fenced(
    redis_client: redis.Redis, newer: bool
) -> None:
    task_id = uuid.uuid4().hex
    job = delivered(task_id, redelivered=False)
    assert ExecutionLeaseStep("tests.ship", ttl=30.0).before_run(job) is RUN
    execution = job.execution
    assert execution.fence is not None
    lose_the_lease(redis_client, task_id)
    if newer:
        # A newer execution took it over and has ended: its release deleted the keys.
        ledger.record_takeover(task_id, execution.key, execution.fence + 1, "host:1")
    released = execution_lease.release(task_id, execution.fence, client=redis_client)
    assert released is execution_lease.Released.GONE
    # The retry path: the job's next message is published unless it was taken over.
    assert hand_back(execution) is (not newer)
    assert execution.lost_lease is newer


def test_a_lease_taken_over_is_lost_without_asking_the_database(
    redis_client: redis.Redis,
) -> None:
    task_id = uuid.uuid4().hex
    stale = delivered(task_id, redelivered=False).execution
    taken = execution_lease.acquire(task_id, ttl=0.05, client=redis_client)
    assert isinstance(taken, execution_lease.Taken)
    stale.fence = taken.fence
    redis_client.delete(execution_lease.lease_key(task_id))  # ran out
    newer = execution_lease.acquire(task_id, ttl=30.0, client=redis_client)
    assert isinstance(newer, execution_lease.Taken) and newer.took_over_from
    give_back(stale)
    assert stale.lost_lease  # the newer execution's marker is there: no fence row needed
    assert not Fence.objects.filter(task_id=task_id).exists()
    execution_lease.release(task_id, newer.fence, client=redis_client)


def test_without_the_database_the_redelivery_keeps_the_lease_and_retries(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence row cannot be written: the job is retried, and the lease kept, so the
    retry finds it not released and takes it over (writing the fence then) instead of
    finding it free with nothing to say it must fence."""
    from django.db import OperationalError

    from celery_explicit import store
    from celery_explicit.steps import RetryLater

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("the database is down")

    monkeypatch.setattr(store.get(), "record_fence", refuse)
    task_id = uuid.uuid4().hex
    job = delivered(task_id, redelivered=True)
    decision = ExecutionLeaseStep("tests.ship", ttl=0.2).before_run(job)
    assert isinstance(decision, RetryLater) and job.execution.fence is None
    assert redis_client.exists(execution_lease.lease_key(task_id))
    import time

    time.sleep(0.3)  # the kept lease runs out
    again = execution_lease.acquire(task_id, ttl=30.0, client=redis_client)
    assert isinstance(again, execution_lease.Taken) and again.took_over_from
    execution_lease.release(task_id, again.fence, client=redis_client)
