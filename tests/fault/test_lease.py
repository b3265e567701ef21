"""The visibility timeout belongs to the task (Redis broker), with real workers.

SlowShip declares a 2 s lease and runs 6 s: the article's incident (a 45 s job under a
30 s timeout), scaled down. The global visibility timeout is 60 s, swept every second.
"""

from __future__ import annotations

import io
import os
import signal
import time
import uuid

import pytest
from django.core.management import call_command

from celery_explicit.execution_lease import live_executions
from celery_explicit.message_lease import live_leases, record_key
from django_outbox.models import Attempt, Outcome
from tests.support.waiting import wait_for
from tests.support.workers import Worker
from tests.testapp.models import Counter
from tests.testapp.tasks import SlowShip, increment_unguarded

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

JOBS = 3


def ran(redis_client, order_id: str) -> list[int]:
    return [int(pid) for pid in redis_client.lrange(f"ran:{order_id}", 0, -1)]


PUBLISHED: dict[str, str] = {}  # order -> task id


def publish(queue: str, seconds: float, jobs: int = JOBS) -> list[str]:
    orders = [uuid.uuid4().hex[:8] for _ in range(jobs)]
    for order in orders:
        Counter.objects.create(name=order)
        PUBLISHED[order] = SlowShip().apply_async(args=[order, order, seconds], queue=queue).id
    return orders


def test_a_job_three_times_its_lease_runs_once_while_alive(
    start_worker, queue, redis_client
) -> None:
    start_worker(concurrency=JOBS)
    start_worker(concurrency=JOBS)
    orders = publish(queue, seconds=6.0)
    # While they run, an operator sees each lease: owner, extensions, time left.
    wait_for(
        lambda: all(ran(redis_client, o) for o in orders), timeout=20, what="every job started"
    )
    time.sleep(1.5)
    ours = {PUBLISHED[o] for o in orders}
    held = [x for x in live_leases(redis_client) if x.task_id in ours]
    assert len(held) == JOBS
    shown = [(x.expires_in, x.extensions) for x in held]
    assert all(0 < left <= 2.0 and extended >= 1 for left, extended in shown), shown
    # ... and each job's execution lease: owner process, fencing token, extended.
    running = [x for x in live_executions(redis_client) if x.task_id in ours]
    assert len(running) == JOBS
    assert len({x.fence for x in running}) == JOBS
    assert all(x.age > 1.5 and 0 < x.expires_in <= 2.0 for x in running)
    call_command("explicit_leases", stdout=(out := io.StringIO()))
    assert all(task_id in out.getvalue() for task_id in ours)
    wait_for(lambda: Attempt.objects.count() >= JOBS, timeout=40, what="every job done")
    time.sleep(2.5)  # a lease past its deadline would have been restored by now
    assert [len(ran(redis_client, o)) for o in orders] == [1] * JOBS  # zero redeliveries
    assert Attempt.objects.filter(outcome=Outcome.APPLIED).count() == JOBS
    assert not Attempt.objects.filter(redelivered=True).exists()


def test_negative_control_without_extension_the_job_is_redelivered(
    start_worker, queue, redis_client
) -> None:
    no_extend = {"EXPLICIT_LEASE_EXTEND": "0"}
    start_worker(concurrency=JOBS, extra_env=no_extend)
    start_worker(concurrency=JOBS, extra_env=no_extend)
    orders = publish(queue, seconds=6.0)
    wait_for(
        lambda: all(len(ran(redis_client, o)) >= 2 for o in orders),
        timeout=40,
        what="every job handed to a second execution",
    )
    # The ledger still keeps the effect single, which is why redelivery alone is not
    # the bug; running the handler twice (and calling the warehouse twice) is. With no
    # extension a job may not be applied at all: each execution can be taken over
    # before it commits (its lease is shorter than its run, the configuration this
    # control shows is wrong), so what is asserted is "never twice", after a whole run
    # past the takeovers for any commit to land.
    time.sleep(8.0)
    assert {Counter.objects.get(name=o).value for o in orders} <= {0, 1}
    assert Attempt.objects.filter(outcome=Outcome.APPLIED).count() <= JOBS


def holder_and_other(
    workers: tuple[Worker, Worker], redis_client, order: str
) -> tuple[Worker, Worker]:
    """Which of two running workers got the job, and the other one.

    Both are started before the job is published: a worker started while the job runs
    could take longer to start than the job takes to end.
    """
    wait_for(lambda: ran(redis_client, order), timeout=20, what="the job to start")
    (pid,) = ran(redis_client, order)
    a, b = workers
    assert pid in (a.process.pid, b.process.pid)
    return (a, b) if pid == a.process.pid else (b, a)


def test_a_killed_worker_s_job_runs_again_within_its_own_lease(
    start_worker, queue, redis_client
) -> None:
    workers = start_worker(concurrency=2), start_worker(concurrency=2)
    (order,) = publish(queue, seconds=4.0, jobs=1)
    holder, other = holder_and_other(workers, redis_client, order)
    # Its message has its own lease within 0.1 s of its delivery (the keeper's first
    # look, tests/integration/test_lease_keeper.py); a kill before that would leave it
    # to the global timeout.
    wait_for(
        lambda: redis_client.exists(record_key(PUBLISHED[order])),
        timeout=5,
        what="the message's own lease",
    )
    killed_at = time.monotonic()
    os.killpg(holder.process.pid, signal.SIGKILL)  # the whole worker, children included
    wait_for(lambda: len(ran(redis_client, order)) == 2, timeout=30, what="the job to run again")
    rerun_after = time.monotonic() - killed_at
    assert ran(redis_client, order)[1] == other.process.pid
    # Its 2 s lease plus one 1 s sweep (and a heartbeat), not the 60 s global timeout.
    assert rerun_after < 10.0
    wait_for(
        lambda: Attempt.objects.filter(
            idempotency_key=f"order:{order}:ship", outcome=Outcome.APPLIED
        ).exists(),
        timeout=20,
        what="the effect",
    )
    assert Counter.objects.get(name=order).value == 1


def test_a_stopped_child_loses_its_lease_and_another_worker_takes_the_job(
    start_worker, queue, redis_client
) -> None:
    workers = start_worker(concurrency=1), start_worker(concurrency=1)
    (order,) = publish(queue, seconds=4.0, jobs=1)
    holder, other = holder_and_other(workers, redis_client, order)
    (child,) = holder.child_pids()
    os.kill(child, signal.SIGSTOP)  # a GC pause, a debugger, a frozen VM
    try:
        wait_for(
            lambda: len(ran(redis_client, order)) == 2,
            timeout=20,
            what="another worker to take the job",
        )
        assert ran(redis_client, order) == [holder.process.pid, other.process.pid]
        wait_for(
            lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists(),
            timeout=20,
            what="the second worker's effect",
        )
    finally:
        os.kill(child, signal.SIGCONT)
    # The first execution wakes up and reaches its effect: the second one took its
    # execution lease over, so its commit is refused (fenced).
    wait_for(
        lambda: Attempt.objects.filter(outcome=Outcome.FENCED).exists(),
        timeout=20,
        what="the resumed execution",
    )
    assert Counter.objects.get(name=order).value == 1


def test_negative_control_a_plain_task_of_a_killed_worker_waits_for_the_global_timeout(
    start_worker, queue, redis_client
) -> None:
    Counter.objects.create(name="plain")
    workers = start_worker(concurrency=1), start_worker(concurrency=1)
    increment_unguarded.apply_async(
        kwargs={"name": "plain", "op_id": "1", "hold": 8.0}, queue=queue
    )
    # Its message is held unacknowledged by the worker that received it (no lease of
    # its own); kill that one.
    wait_for(
        lambda: redis_client.hlen("unacked") and any(w.log().count(" received") for w in workers),
        timeout=20,
        what="the plain job to start",
    )
    (holder,) = [w for w in workers if " received" in w.log()]
    os.killpg(holder.process.pid, signal.SIGKILL)
    time.sleep(10.0)  # where the ExplicitTask above had long run again
    assert Counter.objects.get(name="plain").value == 0  # not rerun: waits the 60 s backstop
