"""Fault test: a Redis failover never hands out a fencing token twice (a lock's, or an
execution lease's).

Each round runs a private primary and replica on loopback, the replication link through
a proxy. A first holder takes and releases the lock (the replica has the counter), then
the link loses everything the primary sends (what asynchronous replication loses when
the primary dies), A takes the lock on the primary, the primary is killed and the
replica promoted, and B takes the same lock on it. B's token must be larger than A's,
and A's stale ``fenced_update`` after B's write refused.

The negative control runs the acquisition script that seeded the counter from the
server clock only when it was missing: the promoted replica still has the older
counter, so B gets A's token exactly and A's stale write lands.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter as Tally
from pathlib import Path

import pytest

from celery_explicit import execution_lease, locks
from celery_explicit.errors import LockNotReplicated
from celery_explicit.locks import LeaseLock
from django_outbox.models import Attempt, Fence, Outcome
from tests.support.replication import (
    COUNTER_ONLY,
    EXECUTION_COUNTER_ONLY,
    PrimaryReplica,
    stale_write,
    tokens,
)
from tests.support.scale import scaled
from tests.support.sentinel import SentinelGroup
from tests.support.waiting import wait_for
from tests.testapp.models import OrderState, Profile
from tests.testapp.tasks import ShipToAddress

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = scaled(10, 50)
#: Rounds of a stale execution across a Sentinel failover, with real workers.
STALE_ROUNDS = scaled(1, 10)


def one_round(data_dir: Path, user_id: int, *, control: bool) -> tuple[str, str]:
    pair = PrimaryReplica(data_dir)
    try:
        Profile.objects.create(user_id=user_id, data="initial")
        rows = Profile.objects.filter(user_id=user_id)
        name = f"profile:{user_id}"
        first = LeaseLock(pair.client(), name, ttl=30.0, prefix="failover:")
        first.acquire()
        first.release()
        pair.wait_in_sync()  # the replica holds the counter as the primary left it

        pair.sever()
        a = LeaseLock(pair.client(), name, ttl=30.0, prefix="failover:")
        fence_a = a.acquire()
        pair.fail_over()
        b = LeaseLock(pair.client(), name, ttl=30.0, prefix="failover:")
        fence_b = b.acquire()

        return tokens(fence_a, fence_b), stale_write(rows, fence_a, fence_b)
    finally:
        pair.stop()


@pytest.mark.parametrize("control", [False, True], ids=["clock-floor", "negative-control"])
def test_a_failover_never_hands_out_a_fencing_token_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, control: bool
) -> None:
    if control:
        monkeypatch.setattr(locks, "ACQUIRE", COUNTER_ONLY)
    outcomes = Tally(
        one_round(tmp_path / f"round-{i}", 9_000 + i, control=control) for i in range(ROUNDS)
    )
    if control:
        assert outcomes == Tally({("token handed out twice", "stale write applied"): ROUNDS})
    else:
        assert outcomes == Tally({("B's token larger", "stale write refused"): ROUNDS})


def test_replicas_asked_for_hold_the_token_or_the_lock_is_not_taken(tmp_path: Path) -> None:
    pair = PrimaryReplica(tmp_path)
    try:
        name = f"replicated:{uuid.uuid4().hex[:8]}"
        held = LeaseLock(pair.client(), name, ttl=2.0, prefix="failover:", replicas=1)
        fence = held.acquire()
        assert fence > 0 and held.token is not None
        held.release()

        pair.sever()
        cut_off = LeaseLock(pair.client(), name, ttl=2.0, prefix="failover:", replicas=1)
        with pytest.raises(LockNotReplicated, match=rf"lock {name}: 0 of the 1 replicas"):
            cut_off.acquire()
        assert cut_off.token is None
        # Released again: another holder takes it at once on the primary.
        assert LeaseLock(pair.client(), name, ttl=2.0, prefix="failover:").acquire() > fence
    finally:
        pair.stop()


def one_takeover(data_dir: Path) -> str:
    """A job whose holder X died (its marker and counter replicated), taken over by A on
    the primary while replication is lost, then by B on the promoted replica."""
    pair = PrimaryReplica(data_dir)
    try:
        task_id = uuid.uuid4().hex
        x = execution_lease.acquire(task_id, ttl=0.05, client=pair.client())
        assert isinstance(x, execution_lease.Taken)
        time.sleep(0.1)  # X's lease runs out, never released
        pair.wait_in_sync()
        pair.sever()
        a = execution_lease.acquire(task_id, ttl=30.0, client=pair.client())
        pair.fail_over()
        b = execution_lease.acquire(task_id, ttl=30.0, client=pair.client())
        assert isinstance(a, execution_lease.Taken) and isinstance(b, execution_lease.Taken)
        assert a.took_over_from and b.took_over_from  # both took over from X
        return tokens(a.fence, b.fence)
    finally:
        pair.stop()


@pytest.mark.parametrize("control", [False, True], ids=["clock-floor", "negative-control"])
def test_a_failover_never_hands_out_an_execution_token_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, control: bool
) -> None:
    if control:
        monkeypatch.setattr(execution_lease, "ACQUIRE", EXECUTION_COUNTER_ONLY)
    outcomes = Tally(one_takeover(tmp_path / f"round-{i}") for i in range(ROUNDS))
    expected = "token handed out twice" if control else "B's token larger"
    assert outcomes == Tally({expected: ROUNDS})


def stale_across_a_failover(start_worker, redis_client, tmp_path: Path, order_id: int, env):  # type: ignore[no-untyped-def]
    """Holder A runs the job with its lease on a primary whose writes no longer reach the
    replica; A is stopped, the primary dies and the Sentinels promote the replica (A's
    lease is gone); B, started after the failover, gets the job again once A's message
    lease runs out; A wakes up while B runs and tries to commit."""
    group = SentinelGroup(tmp_path)
    workers = []
    try:
        env = {**env, "EXPLICIT_TEST_STATE_URL": group.url}
        # One pool process and a prefetch of one: A's worker takes nothing more while A
        # is stopped, so the job's next delivery goes to B.
        workers.append(start_worker(concurrency=1, extra_env=env))
        group.sever()
        tag = uuid.uuid4().hex[:8]
        Profile.objects.create(user_id=order_id, data="old address")
        ShipToAddress().apply_async(args=[order_id, tag], queue=workers[0].queue)
        stale_pid = int(
            wait_for(lambda: redis_client.lindex(f"started:{tag}", 0), timeout=20, what="A")
        )
        os.kill(stale_pid, signal.SIGSTOP)
        redis_client.set(f"stopped:{tag}", 1, ex=60)
        try:
            group.kill_primary()
            group.wait_for_failover()
            Profile.objects.filter(user_id=order_id).update(data="new address")
            workers.append(start_worker(concurrency=1, extra_env=env))
            wait_for(
                lambda: redis_client.llen(f"started:{tag}") == 2,
                timeout=30,
                what="B, after A's message lease ran out",
            )
        finally:
            os.kill(stale_pid, signal.SIGCONT)
        stale = wait_for(
            lambda: Attempt.objects.filter(
                worker_pid=stale_pid, idempotency_key=f"ship:{order_id}"
            ).first(),
            timeout=20,
            what="A's attempt",
        )
        redis_client.set(f"proceed:{tag}", 1, ex=60)
        wait_for(
            lambda: Attempt.objects.filter(idempotency_key=f"ship:{order_id}").count() == 2,
            timeout=20,
            what="B's attempt",
        )
        shipped = list(
            OrderState.objects.filter(order_id=order_id).values_list("status", flat=True)
        )
        assert len(shipped) == 1  # the ledger: one effect either way
        if stale.outcome == Outcome.FENCED and shipped == ["new address"]:
            return "stale commit refused"
        if stale.outcome == Outcome.APPLIED and shipped == ["old address"]:
            return "stale commit applied"
        return f"unexpected: {stale.outcome} {shipped}"
    finally:
        for worker in workers:
            worker.stop()
        group.stop()


@pytest.mark.worker
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "stale commit refused"),
        ({"EXPLICIT_TEST_NO_REDELIVERY_FENCE": "1"}, "stale commit applied"),
    ],
    ids=["fenced", "negative-control"],
)
def test_a_stale_execution_cannot_commit_after_a_failover_lost_its_lease(
    start_worker, redis_client, tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    """The failover lost A's lease, so B finds it free: no takeover is seen in Redis. B's
    redelivery writes its fence to the database all the same, and A's commit is refused
    as after a takeover. Negative control: B runs without writing it, and A's stale
    commit lands (the ledger keeps it to one effect: the wrong one)."""
    outcomes = Tally(
        stale_across_a_failover(start_worker, redis_client, tmp_path / f"round-{i}", 7_000 + i, env)
        for i in range(STALE_ROUNDS)
    )
    assert outcomes == Tally({expected: STALE_ROUNDS})
    if not env:
        assert Fence.objects.filter(cause="unleased").count() == STALE_ROUNDS
