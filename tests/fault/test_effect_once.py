"""Fault tests: many duplicates and crashes, outcomes counted, each with a negative control.

The invariant checked after each history: every counter moved exactly once per
operation. The negative control runs the same history through a plain acks_late
Celery task (same update, no ledger) and must break the invariant, proving the check
can fail.
"""

from __future__ import annotations

from collections import Counter as Tally

import pytest

from django_outbox.models import Attempt, Outcome, ProcessedOperation
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment, increment_unguarded

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

KEYS = 24
COPIES = 3


def final_values(prefix: str) -> Tally[int]:
    return Tally(Counter.objects.filter(name__startswith=prefix).values_list("value", flat=True))


def publish_duplicates(task, prefix: str, queue: str) -> None:  # type: ignore[no-untyped-def]
    for copy in range(COPIES):
        for i in range(KEYS):
            task.apply_async(
                kwargs={"name": f"{prefix}{i}", "op_id": "op", "hold": 0.05},
                queue=queue,
                task_id=f"{prefix}{i}-{copy}",
            )


def test_concurrent_duplicates_across_workers_apply_once(start_worker, queue):
    Counter.objects.bulk_create(Counter(name=f"dup{i}") for i in range(KEYS))
    start_worker(concurrency=2)
    start_worker(concurrency=2)
    publish_duplicates(Increment(), "dup", queue)
    wait_for(
        lambda: Attempt.objects.count() == KEYS * COPIES, timeout=60, what="every copy executed"
    )
    assert final_values("dup") == Tally({1: KEYS})
    assert ProcessedOperation.objects.count() == KEYS
    tally = Tally(Attempt.objects.values_list("outcome", flat=True))
    assert tally == Tally({Outcome.APPLIED: KEYS, Outcome.ALREADY_APPLIED: KEYS * (COPIES - 1)})
    # The copies really ran in more than one process at a time.
    assert Attempt.objects.values("worker_pid").distinct().count() >= 3


def test_negative_control_without_ledger_applies_duplicates(start_worker, queue):
    Counter.objects.bulk_create(Counter(name=f"ctl{i}") for i in range(KEYS))
    start_worker(concurrency=2)
    start_worker(concurrency=2)
    publish_duplicates(increment_unguarded, "ctl", queue)
    wait_for(
        lambda: sum(final_values("ctl").elements()) == KEYS * COPIES,
        timeout=60,
        what="every copy executed",
    )
    assert final_values("ctl")[1] == 0  # every key moved more than once


CRASHES = 8


def test_crash_after_commit_before_ack_never_repeats_the_effect(start_worker, queue):
    Counter.objects.bulk_create(Counter(name=f"crash{i}") for i in range(CRASHES))
    worker = start_worker(concurrency=2)
    for i in range(CRASHES):
        Increment().apply_async(
            kwargs={"name": f"crash{i}", "op_id": "op", "die_after_effect": True}, queue=queue
        )
    wait_for(
        lambda: Attempt.objects.filter(outcome=Outcome.ALREADY_APPLIED).count() == CRASHES,
        timeout=90,
        what="every crashed job redelivered",
    )
    assert final_values("crash") == Tally({1: CRASHES})
    assert worker.log().count("WorkerLostError") >= CRASHES


def test_negative_control_crash_without_ledger_repeats_the_effect(
    start_worker, queue, redis_client
):
    Counter.objects.bulk_create(Counter(name=f"ctlcrash{i}") for i in range(CRASHES))
    redis_client.delete(*[f"died:ctlcrash{i}:op" for i in range(CRASHES)])
    start_worker(concurrency=2)
    for i in range(CRASHES):
        increment_unguarded.apply_async(
            kwargs={"name": f"ctlcrash{i}", "op_id": "op", "die_after_effect": True}, queue=queue
        )
    wait_for(
        lambda: final_values("ctlcrash") == Tally({2: CRASHES}),
        timeout=90,
        what="every crashed job applied twice",
    )
