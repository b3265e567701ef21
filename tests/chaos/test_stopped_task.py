"""A running task stopped (SIGSTOP) past its lease, then continued, many times.

Must hold: one effect per key; every stale commit fenced and counted (a fence row per
takeover, the stale execution's attempt ``fenced``). Negative control: with the
execution lease off the stale commit lands.

Each round is the scenario of tests/fault/test_execution_lease.py (``stop_and_wake``):
two single-process workers, the holder stopped until a second execution starts,
the order's address changed meanwhile, the holder continued after the newer one.
"""

from __future__ import annotations

import time
from collections import Counter as Tally

import pytest

from django_outbox.models import Attempt, Fence, Outcome
from tests.chaos.report import Row, scaled
from tests.fault.test_execution_lease import stop_and_wake

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(scaled(300, 3600)),
]

ROUNDS = scaled(4, 100)


def rounds(start_worker, redis_client, lease: str, first_order: int) -> Tally[str]:  # type: ignore[no-untyped-def]
    env = {"EXPLICIT_EXECUTION_LEASE": lease}
    workers = [start_worker(concurrency=1, extra_env=env) for _ in range(2)]
    try:
        return Tally(
            stop_and_wake(redis_client, workers[0].queue, order)
            for order in range(first_order, first_order + ROUNDS)
        )
    finally:
        # Stopped before the next call's workers start on the same queue: left running,
        # the lease-on workers took some of the control's rounds and fenced their stale
        # commit, so the control could miss in every round (seen: 2 of 4 landed).
        for worker in workers:
            worker.stop()


def test_stopped_past_its_lease(start_worker, redis_client) -> None:
    started = time.monotonic()
    outcomes = rounds(start_worker, redis_client, "1", 0)
    fenced = Attempt.objects.filter(outcome=Outcome.FENCED).count()
    fences = Fence.objects.count()
    control = rounds(start_worker, redis_client, "0", 10_000)
    # stop_and_wake asserts one effect per order in every round (the ledger); what
    # differs is whose commit landed: the newer execution's, or the stale one's.
    row = Row(
        scenario="stopped task",
        fault="SIGSTOP a running task past its lease, then SIGCONT",
        faults=ROUNDS,
        jobs=ROUNDS,
        lost=0,
        duplicates=0,
        figures={"stale commits fenced": fenced, "fence rows (takeovers)": fences},
        holds=outcomes == Tally({"stale commit refused": ROUNDS})
        and fenced == ROUNDS
        and fences == ROUNDS,
        control=f"execution lease off: {control['stale commit applied']} stale commits landed",
        control_failed=control["stale commit applied"] > 0,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, (row, outcomes, control)
