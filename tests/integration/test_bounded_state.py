"""What bounds our Redis state, on real Redis: a lock's fence counter expires with its
lock and a recreated one still gives larger tokens; an idle entity's ordering state
keeps two counters for the idle horizon, and forgotten it is a new entity's; function
libraries not registered for the horizon are removed (on a private redis-server: the
shared one's libraries belong to every test session)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_explicit import execution_lease, ordering, redis_scripts, redis_state
from celery_explicit.locks import LeaseLock

# --- lock fence counters ------------------------------------------------------------------


def test_a_lock_fence_counter_expires_with_its_lock(redis_client: redis.Redis, prefix: str) -> None:
    lock = LeaseLock(redis_client, f"rebuild:{uuid.uuid4().hex}", ttl=30.0, prefix=prefix)
    lock.acquire()
    counter_ttl = redis_client.pttl(lock.fence_key)
    assert 0 < counter_ttl <= 30_000
    assert counter_ttl >= redis_client.pttl(lock.key) - 50  # set in the same script
    lock.extend(120.0)
    assert 30_000 < redis_client.pttl(lock.fence_key) <= 120_000
    lock.release()
    assert redis_client.pttl(lock.fence_key) > 0  # never a counter without a TTL


def test_a_recreated_lock_fence_counter_still_gives_a_larger_token(
    redis_client: redis.Redis, prefix: str
) -> None:
    """The counter starts at the server's clock in microseconds, and a token costs a
    script call: after many acquisitions back to back, a counter that expired (deleted
    here) starts above every token the old one gave."""
    name = f"rebuild:{uuid.uuid4().hex}"
    lock = LeaseLock(redis_client, name, ttl=30.0, prefix=prefix)
    tokens = []
    for _ in range(2000):
        with lock.hold() as fence:
            tokens.append(fence)
    assert tokens == sorted(tokens)
    redis_client.delete(lock.fence_key)  # what its expiry does
    with LeaseLock(redis_client, name, ttl=30.0, prefix=prefix).hold() as fence:
        assert fence > tokens[-1]


def test_a_recreated_job_fence_counter_still_gives_a_larger_token(
    redis_client: redis.Redis,
) -> None:
    """The release deletes a job's counter; its next execution gets a larger token."""
    task_id = uuid.uuid4().hex
    first = execution_lease.acquire(task_id, ttl=30.0, client=redis_client)
    assert isinstance(first, execution_lease.Taken)
    assert execution_lease.release(task_id, first.fence, client=redis_client)
    assert not redis_client.exists(
        execution_lease.lease_key(task_id),
        execution_lease.marker_key(task_id),
        execution_lease.fence_key(task_id),
    )
    second = execution_lease.acquire(task_id, ttl=30.0, client=redis_client)
    assert isinstance(second, execution_lease.Taken)
    assert second.fence > first.fence
    assert execution_lease.release(task_id, second.fence, client=redis_client)


def test_a_release_that_is_no_longer_ours_leaves_the_counter(redis_client: redis.Redis) -> None:
    """A holder taken over keeps its hands off: the newer execution's counter stays."""
    task_id = uuid.uuid4().hex
    old = execution_lease.acquire(task_id, ttl=0.05, client=redis_client)
    assert isinstance(old, execution_lease.Taken)
    redis_client.delete(execution_lease.lease_key(task_id))  # its lease ran out
    new = execution_lease.acquire(task_id, ttl=30.0, client=redis_client)
    assert isinstance(new, execution_lease.Taken) and new.took_over_from
    assert not execution_lease.release(task_id, old.fence, client=redis_client)
    assert int(redis_client.get(execution_lease.fence_key(task_id)) or 0) == new.fence
    assert execution_lease.release(task_id, new.fence, client=redis_client)
    assert not redis_client.exists(execution_lease.fence_key(task_id))


# --- ordering ---------------------------------------------------------------------------


@pytest.fixture
def key() -> str:
    return f"order:{uuid.uuid4().hex[:10]}"


def _state(client: redis.Redis, key: str) -> dict[str, int]:
    """The TTL of each of the entity's keys that exists."""
    found = {}
    for part, name in ordering._keys(key).items():
        if client.exists(name):
            found[part] = int(client.ttl(name))
    return found


def test_an_entity_with_jobs_to_come_keeps_its_state_for_the_long_horizon(
    redis_client: redis.Redis, key: str
) -> None:
    first, second = ordering.take_number(key), ordering.take_number(key)
    assert ordering.turn(key, first, "t1", gap=60, lease=5).run
    assert ordering.done(key, first, task_id="t1")
    state = _state(redis_client, key)
    assert set(state) == {"published", "next"}
    assert state["next"] > ordering.IDLE_TTL  # job 2 is still to come
    assert ordering.turn(key, second, "t2", gap=60, lease=5).run
    assert ordering.done(key, second, task_id="t2")


def test_an_idle_entity_keeps_two_counters_for_the_idle_horizon(
    redis_client: redis.Redis, key: str
) -> None:
    numbers = [ordering.take_number(key) for _ in range(3)]
    ordering.give_back(key, numbers[1])  # its publish failed
    assert ordering.turn(key, numbers[0], "t1", gap=60, lease=5).run
    assert ordering.done(key, numbers[0], task_id="t1")
    assert ordering.turn(key, numbers[2], "t3", gap=60, lease=5).run
    assert ordering.done(key, numbers[2], task_id="t3")
    state = _state(redis_client, key)
    assert set(state) == {"published", "next"}  # skipped, waiting and alive are gone
    assert all(0 < ttl <= ordering.IDLE_TTL for ttl in state.values())
    # Within the horizon a late copy of a finished job finds its number passed: it runs.
    assert ordering.turn(key, numbers[0], "t1-copy", gap=60, lease=5).run


def test_a_forgotten_entity_is_a_new_one(redis_client: redis.Redis, key: str) -> None:
    """After the horizon the state is gone: the next job gets number 1 and runs, as
    for an entity never seen."""
    seq = ordering.take_number(key)
    assert ordering.turn(key, seq, "t1", gap=60, lease=5).run
    assert ordering.done(key, seq, task_id="t1")
    redis_client.delete(*ordering._keys(key).values())  # what the idle horizon does
    again = ordering.take_number(key)
    assert again == 1
    assert ordering.turn(key, again, "t2", gap=60, lease=5).run


# --- function libraries -------------------------------------------------------------------


@pytest.fixture
def private_client(private_redis: Path) -> Iterator[redis.Redis]:
    client = redis.Redis(unix_socket_path=str(private_redis))
    yield client
    client.flushall()
    client.execute_command("FUNCTION", "FLUSH")  # type: ignore[no-untyped-call]
    client.close()


def _library(name: str) -> str:
    return f"#!lua name={name}\nredis.register_function('{name}_f', function() return 1 end)\n"


def _libraries(client: redis.Redis) -> set[str]:
    listed = client.execute_command("FUNCTION", "LIST")  # type: ignore[no-untyped-call]
    return {
        (entry[1] if isinstance(entry, list) else entry[b"library_name"]).decode()
        for entry in listed
    }


def test_a_library_nobody_registered_for_the_horizon_is_removed(
    private_client: redis.Redis,
) -> None:
    now = redis_scripts.server_time(private_client)
    old, recent, unknown = (f"celery_explicit_{n}" for n in ("old000000000", "new0", "unk0"))
    for name in (old, recent, unknown):
        private_client.execute_command("FUNCTION", "LOAD", _library(name))  # type: ignore[no-untyped-call]
    registry = redis_scripts.libraries_key()
    private_client.zadd(registry, {old: now - redis_scripts.LIBRARY_HORIZON - 60})
    private_client.zadd(registry, {recent: now - redis_scripts.LIBRARY_HORIZON + 600})
    # This version's first call loads its library, registers it and removes the stale.
    lock = LeaseLock(private_client, "x", ttl=5.0)
    with lock.hold():
        pass
    current = redis_scripts.library().name
    assert _libraries(private_client) == {current, recent, unknown}
    registered = {redis_state.text(n) for n in private_client.zrange(registry, 0, -1)}
    assert registered == {current, recent}  # one never registered is not ours to judge


def test_a_live_version_whose_library_was_removed_loads_it_again(
    private_client: redis.Redis,
) -> None:
    """A process of a version idle past the horizon loses its library to another's
    clean-up: its next call loads it again and registers it."""
    with LeaseLock(private_client, "x", ttl=5.0).hold():
        pass
    current = redis_scripts.library().name
    registry = redis_scripts.libraries_key()
    private_client.zadd(registry, {current: 0})
    assert redis_scripts.remove_stale_libraries(private_client, keep="another") == [current]
    assert current not in _libraries(private_client)
    with LeaseLock(private_client, "x", ttl=5.0).hold():
        pass
    assert current in _libraries(private_client)
    assert private_client.zscore(registry, current)
