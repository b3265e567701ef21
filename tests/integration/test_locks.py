"""Lease locks on real Redis: ownership, expiry, stolen keys, fencing, bounded wait."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from django.core.management import call_command

from celery_explicit import job_log, metrics
from celery_explicit.errors import LockConfigError, LockNotAcquired, LockNotOwned
from celery_explicit.locks import LeaseLock, live_locks


def lock(
    client: redis.Redis, prefix: str, name: str = "rebuild:user:123", ttl: float = 5.0
) -> LeaseLock:
    return LeaseLock(client, name, ttl=ttl, prefix=prefix)


def test_acquire_release_and_exclusion(redis_client, prefix) -> None:
    a, b = lock(redis_client, prefix), lock(redis_client, prefix)
    fence = a.acquire()
    with pytest.raises(LockNotAcquired, match="Cannot acquire lock rebuild:user:123"):
        b.acquire()
    a.release()
    assert b.acquire() > fence  # above the counter and the server clock
    assert redis_client.exists(b.key)
    b.release()
    assert not redis_client.exists(b.key)


def test_ttl_is_set_within_bounds_and_extend_pushes_it(redis_client, prefix) -> None:
    a = lock(redis_client, prefix, ttl=2.0)
    a.acquire()
    pttl = redis_client.pttl(a.key)
    assert 1000 < pttl <= 2000  # a slow round trip may eat some of it, never add
    a.extend(10.0)
    assert 9000 < redis_client.pttl(a.key) <= 10000
    a.release()


def test_fencing_tokens_only_grow_across_holders(redis_client, prefix) -> None:
    fences = []
    for _ in range(20):
        holder = lock(redis_client, prefix)
        fences.append(holder.acquire())
        holder.release()
    assert fences == sorted(fences)
    assert len(set(fences)) == 20


def test_release_and_extend_by_a_non_owner_are_refused(redis_client, prefix) -> None:
    a, b = lock(redis_client, prefix), lock(redis_client, prefix)
    a.acquire()
    with pytest.raises(
        LockNotOwned, match="Cannot release lock rebuild:user:123: this holder never acquired it"
    ):
        b.release()
    b.token = "not-the-owner"
    with pytest.raises(
        LockNotOwned, match="Cannot extend lock rebuild:user:123: no longer owned by this token"
    ) as caught:
        b.extend()
    assert caught.value.lock_name == "rebuild:user:123"
    assert redis_client.get(a.key).decode().startswith(a.token)  # untouched
    a.release()


def test_a_stolen_key_is_never_released_by_the_old_owner(redis_client, prefix) -> None:
    a = lock(redis_client, prefix)
    a.acquire()
    redis_client.set(a.key, "thief|0|0|elsewhere", px=5000)  # someone overwrote the lock
    before = metrics.locks_lost.labels("rebuild", "release")._value.get()
    with pytest.raises(LockNotOwned, match="Cannot release lock rebuild:user:123"):
        a.release()
    assert redis_client.get(a.key) == b"thief|0|0|elsewhere"
    assert metrics.locks_lost.labels("rebuild", "release")._value.get() == before + 1


def test_an_expired_lock_cannot_be_extended_and_leaving_hold_says_so(redis_client, prefix) -> None:
    a = lock(redis_client, prefix, ttl=0.2)
    with pytest.raises(LockNotOwned, match="Cannot release lock"), a.hold():
        time.sleep(0.35)
        b = lock(redis_client, prefix, ttl=5)
        b.acquire()  # expired: the next holder gets it
    # The first holder's token is gone with its expiry: it cannot extend either.
    a.token = "the-expired-holders-token"
    with pytest.raises(LockNotOwned, match="Cannot extend lock rebuild:user:123: no longer"):
        a.extend()
    b.release()


def test_bounded_wait_gets_the_lock_when_released_and_records_the_wait(
    redis_client, prefix
) -> None:
    a, b = lock(redis_client, prefix), lock(redis_client, prefix)
    waits = metrics.lock_wait_seconds.labels("rebuild")
    count_before = sum(s.value for s in waits.collect()[0].samples if s.name.endswith("_count"))
    a.acquire()
    threading.Timer(0.3, a.release).start()
    started = time.monotonic()
    b.acquire(wait=3.0)
    waited = time.monotonic() - started
    assert 0.25 < waited < 2.0
    count_after = sum(s.value for s in waits.collect()[0].samples if s.name.endswith("_count"))
    assert count_after == count_before + 2  # a's and b's acquisitions
    b.release()
    with pytest.raises(LockNotAcquired, match=r"waited \d+\.\d{3}s") as refused:
        a.acquire()
        lock(redis_client, prefix).acquire(wait=0.3)
    assert 0.29 <= refused.value.waited < 3.0  # the whole bounded wait, and not forever


@pytest.mark.parametrize("ttl", [0, -1, "5", None, True])
def test_bad_ttl_is_refused_naming_the_lock(redis_client, ttl) -> None:
    with pytest.raises(LockConfigError, match="Lock rebuild:user:9: ttl must be"):
        LeaseLock(redis_client, "rebuild:user:9", ttl=ttl)


@pytest.mark.parametrize("replicas", [-1, 1.5, "1", True])
def test_bad_replicas_is_refused_naming_the_lock(redis_client, replicas) -> None:
    with pytest.raises(LockConfigError, match="Lock rebuild:user:9: replicas must be"):
        LeaseLock(redis_client, "rebuild:user:9", ttl=5.0, replicas=replicas)


def test_live_locks_show_each_holders_fence_also_in_values_earlier_versions_wrote(
    redis_client, prefix
) -> None:
    a = lock(redis_client, prefix, "rebuild:user:1")
    fence = a.acquire()
    # This version leaves the fence out of the value (it is the counter's while the lock
    # exists) and writes 0 where an older explicit_locks reads it as a number.
    token, written, acquired_ms, owner = redis_client.get(a.key).decode().split("|", 3)
    assert (token, written, owner) == (a.token, "0", a.owner) and int(acquired_ms) > 0
    # A lock an earlier version holds during a rolling deploy: its fence is in the value.
    redis_client.set(
        f"{prefix}lock:{{invoice:7}}", f"{'b' * 32}|12345|{int(time.time() * 1000)}|old:1", px=5000
    )
    live = {x.name: x for x in live_locks(redis_client, prefix=prefix)}
    assert (live["rebuild:user:1"].fence, live["rebuild:user:1"].owner) == (fence, a.owner)
    assert (live["invoice:7"].fence, live["invoice:7"].owner) == (12345, "old:1")
    a.release()
    b = lock(redis_client, prefix, "rebuild:user:1")
    fence_b = b.acquire()
    assert fence_b > fence  # above the counter and the server clock
    live = {x.name: x for x in live_locks(redis_client, prefix=prefix)}
    assert live["rebuild:user:1"].fence == fence_b
    b.release()


def test_an_acquisition_whose_fence_fails_leaves_no_lock_behind(redis_client, prefix) -> None:
    a = lock(redis_client, prefix)
    redis_client.hset(a.fence_key, "not", "a counter")  # a counter someone broke
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        a.acquire()
    # The lock was set before the INCR failed: taken back, not held for its TTL by a
    # token nobody has.
    assert not redis_client.exists(a.key) and a.token is None
    redis_client.delete(a.fence_key)
    assert a.acquire() > 0
    a.release()


def test_a_lock_taken_in_a_job_adds_itself_to_the_jobs_log_fields(redis_client, prefix) -> None:
    outside = lock(redis_client, prefix, "invoice:1")
    outside.acquire()
    assert job_log.current() == {}  # no job: nothing kept
    outside.release()
    bound = job_log.bind({"task": "shop.ship_order"})
    try:
        a = lock(redis_client, prefix)
        fence = a.acquire()
        fields, token = job_log.current(), a.token
    finally:
        job_log.reset(bound)
    a.release()
    assert fields["task"] == "shop.ship_order"
    assert (fields["lock_key"], fields["owner_token"], fields["fencing_token"]) == (
        "rebuild:user:123",
        token,
        fence,
    )
    waited = fields["lock_wait_ms"]
    assert isinstance(waited, float) and 0 <= waited < 1000 and round(waited, 3) == waited


@pytest.mark.django_db
def test_operators_can_list_live_locks(redis_client, prefix, capsys, settings) -> None:
    a = lock(redis_client, prefix, "rebuild:user:1")
    b = lock(redis_client, prefix, "invoice:7")
    a.acquire()
    b.acquire()
    time.sleep(0.1)
    live = live_locks(redis_client, prefix=prefix)
    assert [x.name for x in live] == ["invoice:7", "rebuild:user:1"]
    assert all(x.owner == a.owner and 0.05 < x.age < 5 and 0 < x.expires_in <= 5 for x in live)
    settings.EXPLICIT_REDIS_URL = settings.REDIS_URL
    call_command("explicit_locks", "--prefix", prefix)
    out = capsys.readouterr().out
    assert "rebuild:user:1" in out and "invoice:7" in out and a.owner in out
    a.release()
    b.release()
    assert live_locks(redis_client, prefix=prefix) == []


@pytest.mark.django_db
def test_fenced_update_allows_the_same_holder_and_refuses_older_tokens() -> None:
    from celery_explicit.errors import StaleFencingToken
    from django_outbox.store.guarded_writes import fenced_update
    from tests.testapp.models import Profile

    Profile.objects.create(user_id=5)
    rows = Profile.objects.filter(user_id=5)
    assert fenced_update(rows, token=7, data="first") == 1
    assert fenced_update(rows, token=7, data="again") == 1  # same holder, same token
    with pytest.raises(StaleFencingToken, match="token 6 is older than the stored 7") as caught:
        fenced_update(rows, token=6, data="stale")
    assert caught.value.target == "testapp.Profile"
    assert rows.get().data == "again"
    assert fenced_update(Profile.objects.filter(user_id=404), token=9, data="x") == 0


def test_the_blocks_own_error_wins_over_a_lost_lock(redis_client, prefix) -> None:
    a = lock(redis_client, prefix, ttl=0.1)
    with pytest.raises(KeyError, match="downstream"), a.hold():
        time.sleep(0.2)  # the lock expires while the block runs
        raise KeyError("downstream")
