"""Times that one host writes and another compares are the Redis server's: a host
whose clock is an hour off changes nothing. Each test asks from a host an hour
behind (``time.time`` patched in this process), then from a true one."""

from __future__ import annotations

import time
import uuid

import pytest

from celery_explicit import downstream, execution_lease, ordering
from celery_explicit.redis_scripts import server_time

HOUR = 3600.0


@pytest.fixture
def host_behind(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Call it to put this host's clock an hour behind; call ``.restore()`` to fix it."""
    true_time = time.time

    class Clock:
        def __call__(self) -> None:
            monkeypatch.setattr(time, "time", lambda: true_time() - HOUR)

        def restore(self) -> None:
            monkeypatch.setattr(time, "time", true_time)

    return Clock()


def test_an_ordering_gap_is_timed_by_the_server(redis_client, host_behind) -> None:
    key = f"clock:{uuid.uuid4().hex[:8]}"
    host_behind()
    # Job 1 of the entity never came: job 2 starts the gap clock on a host behind...
    assert not ordering.turn(key, 2, "t2", gap=30.0, lease=5.0, client=redis_client).run
    host_behind.restore()
    # ... and a true host finds it an hour old on its own clock, 0 s on the server's.
    assert not ordering.turn(key, 2, "t2", gap=30.0, lease=5.0, client=redis_client).run

    short = f"clock:{uuid.uuid4().hex[:8]}"
    assert not ordering.turn(short, 2, "t2", gap=0.2, lease=5.0, client=redis_client).run
    time.sleep(0.3)
    turn = ordering.turn(short, 2, "t2", gap=0.2, lease=5.0, client=redis_client)
    assert turn.run and turn.skipped_ahead  # the gap still runs out on the server's clock


def test_a_breaker_opened_on_a_host_behind_stays_open(redis_client, host_behind) -> None:
    name = f"clock-{uuid.uuid4().hex[:8]}"
    ds = downstream.Downstream(name, concurrency=2, failure_threshold=1, cool_down=30.0)
    host_behind()
    downstream.enter(ds, "t1", slot_ttl=5.0, redis_client=redis_client)
    assert downstream.leave(ds, "t1", failed=True, redis_client=redis_client).value == "open"
    host_behind.restore()
    # On the true host's clock the cool-down ended an hour ago; on the server's it began.
    verdict, _state = downstream.enter(ds, "t2", slot_ttl=5.0, redis_client=redis_client)
    assert verdict == downstream.Admission.OPEN
    assert downstream.slots_in_use(ds, redis_client=redis_client) == 0


def test_an_execution_lease_records_when_it_was_taken_on_the_server(
    redis_client, host_behind
) -> None:
    job = uuid.uuid4().hex
    host_behind()
    taken = execution_lease.acquire(job, ttl=10.0, client=redis_client)
    host_behind.restore()
    assert isinstance(taken, execution_lease.Taken)
    (live,) = [e for e in execution_lease.live_executions(redis_client) if e.task_id == job]
    assert live.age < 5.0  # not an hour
    assert abs(server_time(redis_client) - time.time()) < 5.0
    execution_lease.release(job, taken.fence, client=redis_client)
