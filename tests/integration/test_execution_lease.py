"""The execution lease and its fence, against real Redis and PostgreSQL.

One live execution per job; a stale execution (its lease taken over) cannot commit its
effect; a dead holder on this host is taken over at once.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from django.utils import timezone

from celery_explicit import execution_lease
from celery_explicit.errors import LeaseLost
from django_outbox.models import Fence, ProcessedOperation
from django_outbox.store import ledger


@pytest.fixture
def job() -> str:
    return f"job-{uuid.uuid4().hex[:10]}"


def test_second_acquire_is_held_until_released(redis_client, job) -> None:
    first = execution_lease.acquire(job, ttl=5, client=redis_client)
    assert isinstance(first, execution_lease.Taken) and first.cause is None
    second = execution_lease.acquire(job, ttl=5, client=redis_client)
    assert isinstance(second, execution_lease.Held)
    assert second.holder == execution_lease.owner()
    assert 4.0 < second.retry_in <= 5.0
    assert execution_lease.release(job, first.fence, client=redis_client)
    third = execution_lease.acquire(job, ttl=5, client=redis_client)
    assert isinstance(third, execution_lease.Taken)
    assert third.fence > first.fence and third.took_over_from == ""
    execution_lease.release(job, third.fence, client=redis_client)


def test_expired_lease_is_taken_over_and_the_stale_release_refused(redis_client, job) -> None:
    first = execution_lease.acquire(job, ttl=0.05, client=redis_client)
    assert isinstance(first, execution_lease.Taken)
    import time

    time.sleep(0.1)
    second = execution_lease.acquire(job, ttl=5, client=redis_client)
    assert isinstance(second, execution_lease.Taken)
    assert second.cause == "lease_expired"
    assert second.took_over_from == execution_lease.owner()
    assert second.fence > first.fence
    # The stale holder cannot release (or end) the newer holder's lease.
    assert not execution_lease.release(job, first.fence, client=redis_client)
    assert isinstance(
        execution_lease.acquire(job, ttl=5, client=redis_client), execution_lease.Held
    )
    assert execution_lease.release(job, second.fence, client=redis_client)


def test_dead_holder_on_this_host_is_taken_over_at_once(redis_client, job) -> None:
    # A process that takes the lease and exits without releasing it (a killed child).
    code = (
        "import redis, sys; from celery_explicit import execution_lease as e; "
        f"e.acquire({job!r}, ttl=60, client=redis.Redis.from_url(sys.argv[1]))"
    )
    from django.conf import settings

    subprocess.run([sys.executable, "-c", code, settings.REDIS_URL], check=True)
    taken = execution_lease.acquire(job, ttl=5, client=redis_client)
    assert isinstance(taken, execution_lease.Taken)
    assert taken.cause == "holder_dead"
    execution_lease.release(job, taken.fence, client=redis_client)


def test_extend_moves_only_the_owners_lease(redis_client, job) -> None:
    taken = execution_lease.acquire(job, ttl=1, client=redis_client)
    assert isinstance(taken, execution_lease.Taken)
    me = execution_lease.owner()
    assert execution_lease.extend_all(redis_client, [(job, "otherhost:1", 30)]) == 0
    assert redis_client.pttl(execution_lease.lease_key(job)) <= 1000
    assert execution_lease.extend_all(redis_client, [(job, me, 30)]) == 1
    assert redis_client.pttl(execution_lease.lease_key(job)) > 20000
    execution_lease.release(job, taken.fence, client=redis_client)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_trips", [True, False], ids=["one-string-commit", "cursor"])
def test_effect_of_a_fenced_out_execution_does_not_commit(settings, job, round_trips) -> None:
    settings.EXPLICIT_LEDGER_ROUND_TRIPS = round_trips
    Fence.objects.create(task_id=job, token=10, taken_over_at=timezone.now())
    key = f"k:{job}"
    with (
        pytest.raises(LeaseLost) as refused,
        ledger.effect(key=key, fingerprint="f", task_name="t", task_id=job, fence=9),
    ):
        pass
    assert refused.value.token == 9 and refused.value.current == 10
    assert job in str(refused.value) and key in str(refused.value)
    assert not ProcessedOperation.objects.filter(key=key).exists()
    # The newer holder (and any token not older than the fence) commits.
    with ledger.effect(key=key, fingerprint="f", task_name="t", task_id=job, fence=10):
        pass
    assert ProcessedOperation.objects.filter(key=key).exists()


def test_record_takeover_keeps_the_largest_token(db, job) -> None:
    ledger.record_takeover(job, "k", 7, "h:1")
    ledger.record_takeover(job, "k", 5, "h:2")  # a late, older announcement
    assert Fence.objects.get(task_id=job).token == 7
    ledger.record_takeover(job, "k", 9, "h:3")
    assert Fence.objects.get(task_id=job).token == 9


def test_a_takeover_not_released_stays_a_takeover(redis_client, job) -> None:
    """A takeover whose Fence row could not be written keeps its lease (no release):
    the next execution must still see a takeover, or no fence would ever be written."""
    import time

    stale = execution_lease.acquire(job, ttl=0.05, client=redis_client)
    assert isinstance(stale, execution_lease.Taken)
    time.sleep(0.1)
    newer = execution_lease.acquire(job, ttl=0.05, client=redis_client)
    assert isinstance(newer, execution_lease.Taken) and newer.cause == "lease_expired"
    time.sleep(0.1)  # the database was down: it retries later without releasing
    again = execution_lease.acquire(job, ttl=5, client=redis_client)
    assert isinstance(again, execution_lease.Taken)
    assert again.cause == "lease_expired" and again.fence > newer.fence > stale.fence
    execution_lease.release(job, again.fence, client=redis_client)
