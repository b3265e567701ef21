"""Fault tests: the everyday operations of a deploy keep the promise.

A rolling deploy sends SIGTERM to a worker while it runs jobs. Celery's warm shutdown
waits for them; the job keeps its leases until it ends, so no other worker starts it
meanwhile, on both brokers. The negative control runs the same rounds with the drain's
heartbeat off (``EXPLICIT_DRAIN_HEARTBEAT=0``): on Redis the job is started a second
time on the other worker; RabbitMQ keeps the delivery with the draining worker's open
connection, so there it starts once either way.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter as Tally

import pytest
from kombu import Connection

from django_outbox.models import Attempt, Outcome
from tests.conftest import RABBITMQ_URL
from tests.support.scale import scaled
from tests.support.waiting import wait_for
from tests.support.workers import Worker
from tests.testapp.models import Counter, Profile
from tests.testapp.tasks import HoldsTheLine, ShipToAddress

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(600),
]

#: Rounds of each case: 2 in the suite, a dozen under scripts/chaos (full scale).
ROUNDS = scaled(2, 12)
#: The job outlasts its lease (HoldsTheLine.visibility_timeout = 10 s): without a
#: heartbeat while the worker drains, another worker takes it over before it ends.
SECONDS = 14.0


def first_start(redis_client, key: str, a: Worker, b: Worker) -> tuple[int, Worker, Worker]:  # type: ignore[no-untyped-def]
    """The pid of the job's first start (``started:<key>``), the worker running it and
    the other one."""
    pid = int(wait_for(lambda: redis_client.lindex(f"started:{key}", 0), timeout=20, what="start"))
    return (pid, a, b) if pid in a.child_pids() else (pid, b, a)


def sigterm_mid_job(start_worker, redis_client, env: dict[str, str], broker: str) -> str:  # type: ignore[no-untyped-def]
    """One round: worker A takes a long job and gets SIGTERM 2 s into it; worker B
    serves the same queue. What happened: one start or two, and the effect."""
    op = uuid.uuid4().hex[:8]
    Counter.objects.create(name=op)
    env = {**env, "EXPLICIT_TEST_BROKER_URL": broker}
    a = start_worker(concurrency=1, extra_env=env)
    b = start_worker(concurrency=1, extra_env=env)
    with Connection(broker) as conn:
        HoldsTheLine().apply_async(
            kwargs={"name": op, "op_id": op, "seconds": SECONDS}, queue=a.queue, connection=conn
        )
    _pid, runner, other = first_start(redis_client, op, a, b)
    time.sleep(2)
    runner.process.send_signal(signal.SIGTERM)
    runner.process.wait(timeout=SECONDS + 30)
    wait_for(
        lambda: Attempt.objects.filter(
            idempotency_key=f"line:{op}:{op}", outcome=Outcome.APPLIED
        ).exists(),
        timeout=60,
        what="the job applied",
    )
    time.sleep(1)
    starts = redis_client.llen(f"started:{op}")
    value = Counter.objects.get(name=op).value
    other.stop()
    return f"starts={starts} effect={value}"


@pytest.mark.parametrize(
    ("drain", "expected"),
    [("1", "starts=1 effect=1"), ("0", "starts=2 effect=1")],
    ids=["drained", "negative-control"],
)
def test_sigterm_mid_job_runs_it_once(start_worker, redis_client, broker, drain, expected) -> None:
    env = {"EXPLICIT_DRAIN_HEARTBEAT": drain}
    if broker == RABBITMQ_URL:
        # RabbitMQ keeps the delivery with A while its connection is open (a warm
        # shutdown keeps it until the pool has drained): B is never handed the job,
        # drain heartbeat or not. Measured both ways, so a change in that is seen.
        expected = "starts=1 effect=1"
    # Rolling deploys of several workers at scale: tests/chaos/test_rolling_deploys.py.
    rounds = ROUNDS if broker != RABBITMQ_URL else scaled(1, 6)
    if drain == "0":
        rounds = scaled(1, 6)  # the control shows the double start in every round it runs
    outcomes = Tally(
        sigterm_mid_job(start_worker, redis_client, env, broker) for _ in range(rounds)
    )
    assert outcomes == Tally({expected: rounds})


def stop_past_the_lease(redis_client, tag: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Stop the job's first pool process (SIGSTOP) until another one has taken the job
    over; the pids of the first start and the second."""
    first = int(
        wait_for(lambda: redis_client.lindex(f"started:{tag}", 0), timeout=20, what="start")
    )
    os.kill(first, signal.SIGSTOP)
    redis_client.set(f"stopped:{tag}", 1, ex=120)
    try:
        wait_for(lambda: redis_client.llen(f"started:{tag}") == 2, timeout=30, what="takeover")
    finally:
        os.kill(first, signal.SIGCONT)
    return first, int(redis_client.lindex(f"started:{tag}", 1))


def wait_fenced(order_id: int) -> None:
    wait_for(
        lambda: Attempt.objects.filter(
            idempotency_key=f"ship:{order_id}", outcome=Outcome.FENCED
        ).exists(),
        timeout=30,
        what="the stale copy's fenced attempt",
    )


def a_fresh_worker_applies(
    start_worker, redis_client, env: dict[str, str], order_id: int, tag: str
) -> str:  # type: ignore[no-untyped-def]
    """Once the live copy's worker is dead: "applied" if a fresh worker applies the job
    (its record was kept, the sweep restored it), "lost" if not."""
    fresh = start_worker(concurrency=1, extra_env=env, prefetch_multiplier=1)
    redis_client.set(f"proceed:{tag}", 1, ex=120)
    try:
        wait_for(
            lambda: Attempt.objects.filter(
                idempotency_key=f"ship:{order_id}", outcome=Outcome.APPLIED
            ).exists(),
            timeout=20,  # its lease is 2 s: applied within a few seconds when kept
            what="the job applied by the fresh worker",
        )
    except TimeoutError:
        return "lost"
    finally:
        # No worker of this round serves the next one's queue: its takeover must land
        # on that round's own second worker.
        fresh.stop()
    return "applied"


def stale_ack_then_holder_dies(start_worker, redis_client, env: dict[str, str], n: int) -> str:  # type: ignore[no-untyped-def]
    """One round (Redis broker): worker A's pool process is stopped past its lease;
    worker B takes the job over and is still running it when A wakes up, has its commit
    fenced and acks. B then dies (SIGKILL); a fresh worker C must still apply the job."""
    tag = uuid.uuid4().hex[:8]
    order_id = 1000 + n
    Profile.objects.create(user_id=order_id, data="address")
    # One message per worker at a time: the copy a sweep restores goes to the other
    # worker, never to the stopped one's main process.
    a = start_worker(concurrency=1, extra_env=env, prefetch_multiplier=1)
    b = start_worker(concurrency=1, extra_env=env, prefetch_multiplier=1)
    ShipToAddress().apply_async(args=[order_id, tag], queue=a.queue)
    _pid, stale, live = first_start(redis_client, tag, a, b)
    _first, second = stop_past_the_lease(redis_client, tag)
    if second not in live.child_pids():
        return f"set-up: the takeover ran on the stale worker ({second})"
    wait_fenced(order_id)
    stale.stop()  # its ack has happened: the worker ends normally
    live.kill_group()  # the live copy's worker dies mid-job
    return a_fresh_worker_applies(start_worker, redis_client, env, order_id, tag)


@pytest.mark.parametrize(
    ("holder", "expected"),
    [("1", "applied"), ("0", "lost")],
    ids=["held", "negative-control"],
)
def test_a_stale_copys_ack_never_drops_the_live_copy(
    start_worker, redis_client, holder, expected
) -> None:
    env = {"EXPLICIT_DELIVERY_HOLDER": holder}
    # The control loses the job in every round it runs: one in the suite.
    rounds = ROUNDS if holder == "1" else scaled(1, 6)
    outcomes = Tally(
        stale_ack_then_holder_dies(start_worker, redis_client, env, n) for n in range(rounds)
    )
    assert outcomes == Tally({expected: rounds})


def stale_ack_in_the_holder_then_it_dies(
    start_worker, redis_client, env: dict[str, str], n: int
) -> str:  # type: ignore[no-untyped-def]
    """One round (Redis broker), one worker W of two pool processes: the first's job is
    stopped past its lease, the sweep's copy goes back to W (the only consumer) and W's
    other process takes the job over. The stale copy wakes up, has its commit fenced and
    acks: the same tag, the same holder as the live copy. W then dies (SIGKILL) while
    the live copy runs; a fresh worker must still apply the job."""
    tag = uuid.uuid4().hex[:8]
    order_id = 2000 + n
    Profile.objects.create(user_id=order_id, data="address")
    w = start_worker(concurrency=2, extra_env=env, prefetch_multiplier=1)
    ShipToAddress().apply_async(args=[order_id, tag], queue=w.queue)
    first, second = stop_past_the_lease(redis_client, tag)
    if second == first or second not in w.child_pids():
        return f"set-up: the takeover ran in {second}, not W's other process"
    wait_fenced(order_id)
    time.sleep(0.5)  # its ack follows the attempt's row
    w.kill_group()  # the live copy's worker dies mid-job
    return a_fresh_worker_applies(start_worker, redis_client, env, order_id, tag)


@pytest.mark.parametrize(
    ("holder", "expected"),
    [("1", "applied"), ("0", "lost")],
    ids=["held", "negative-control"],
)
def test_a_stale_copys_ack_in_the_worker_holding_the_live_copy_never_drops_it(
    start_worker, redis_client, holder, expected
) -> None:
    env = {"EXPLICIT_DELIVERY_HOLDER": holder}
    rounds = ROUNDS if holder == "1" else scaled(1, 6)
    outcomes = Tally(
        stale_ack_in_the_holder_then_it_dies(start_worker, redis_client, env, n)
        for n in range(rounds)
    )
    assert outcomes == Tally({expected: rounds})


def deploy_cut_short(start_worker, redis_client, broker: str, how: str) -> str:  # type: ignore[no-untyped-def]
    """Worker A runs a long job and gets SIGTERM 2 s into it; 1 s later the
    deploy loses patience: a second SIGTERM (Celery's cold shutdown: the pool is
    terminated) or SIGKILL to every process of A. Worker B serves the same queue. What
    happened: the job's effect, and the outcome of its last attempt."""
    op = uuid.uuid4().hex[:8]
    Counter.objects.create(name=op)
    env = {"EXPLICIT_TEST_BROKER_URL": broker}
    a = start_worker(concurrency=1, extra_env=env)
    b = start_worker(concurrency=1, extra_env=env)
    with Connection(broker) as conn:
        HoldsTheLine().apply_async(
            kwargs={"name": op, "op_id": op, "seconds": 6.0}, queue=a.queue, connection=conn
        )
    _pid, runner, other = first_start(redis_client, op, a, b)
    time.sleep(2)
    runner.process.send_signal(signal.SIGTERM)
    time.sleep(1)
    if how == "cold":
        runner.process.send_signal(signal.SIGTERM)
    else:
        runner.kill_group()
    runner.process.wait(timeout=30)
    key = f"line:{op}:{op}"
    try:
        wait_for(
            lambda: Attempt.objects.filter(idempotency_key=key, outcome=Outcome.APPLIED).exists(),
            timeout=60,  # the killed copy's lease (10 s), then the 6 s job on B
            what="the job applied on the other worker",
        )
    except TimeoutError:
        return "lost"
    time.sleep(2)  # a second application would land now
    other.stop()
    return f"effect={Counter.objects.get(name=op).value}"


@pytest.mark.parametrize("how", ["cold", "sigkill"])
def test_a_deploy_that_cuts_the_drain_short_loses_nothing(
    start_worker, redis_client, broker, how
) -> None:
    """One round per broker and way (each takes half a minute; tests/chaos/test_kills.py
    and test_rolling_deploys.py repeat kills and deploys at scale). No negative control:
    nothing of ours can be switched off to lose this job (its message stays
    unacknowledged either way); the kill storm's control shows the ledger's part."""
    assert deploy_cut_short(start_worker, redis_client, broker, how) == "effect=1"
