"""Fault test: a worker host whose clock runs ahead does not redeliver live jobs.

kombu's sweep puts back every message whose score is below ``time() -
visibility_timeout``, and the score of a leased message is its deadline. Worker A (a
true clock) runs a 14 s job under a 10 s lease, extended while it runs; worker B, on
the same queue, runs 40 s ahead (``EXPLICIT_TEST_CLOCK_SKEW``). Must hold: the scores
and the sweep read the Redis server's clock, so B never takes the live job: one
handler start per round. Negative control, B's sweep on its own clock
(``EXPLICIT_SERVER_CLOCK=0``, kombu's behaviour): B restores and takes the live job;
the execution lease defers it, and it runs a second time once A has finished.
"""

from __future__ import annotations

import time
import uuid

import pytest

from django_outbox.models import Attempt, Outcome
from tests.support.scale import scaled
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import HoldsTheLine

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(600),
]

ROUNDS = scaled(1, 10)  # 10 under scripts/chaos (full scale)
SECONDS = 14.0  # the job outlasts its 10 s lease: only the heartbeat keeps it
SKEW = "40"  # more than the lease, less than the tests' 60 s backstop


def starts_in_a_round(start_worker, redis_client, queue: str, b_env: dict[str, str]) -> int:  # type: ignore[no-untyped-def]
    """A takes the job first; B, its clock ahead, serves the same queue. The handler's
    starts once the job is applied and every copy has ended."""
    op = uuid.uuid4().hex[:8]
    Counter.objects.create(name=op)
    start_worker(queue=queue, concurrency=1)
    HoldsTheLine().apply_async(kwargs={"name": op, "op_id": op, "seconds": SECONDS}, queue=queue)
    wait_for(lambda: redis_client.llen(f"started:{op}") >= 1, timeout=20, what="the first start")
    start_worker(queue=queue, concurrency=1, extra_env={"EXPLICIT_TEST_CLOCK_SKEW": SKEW, **b_env})
    key = f"line:{op}:{op}"
    wait_for(
        lambda: Attempt.objects.filter(idempotency_key=key, outcome=Outcome.APPLIED).exists(),
        timeout=SECONDS + 30,
        what="the job applied",
    )
    # A copy B took is deferred by the execution lease, and starts once A has ended.
    settle = time.monotonic() + 15.0
    while time.monotonic() < settle and redis_client.llen(f"started:{op}") < 2:
        time.sleep(0.2)
    assert Counter.objects.get(name=op).value == 1
    return int(redis_client.llen(f"started:{op}"))


def test_a_worker_whose_clock_runs_ahead_does_not_redeliver_a_live_job(
    start_worker, redis_client, queue
) -> None:
    kept = [
        starts_in_a_round(start_worker, redis_client, f"{queue}-{n}", {}) for n in range(ROUNDS)
    ]
    control = [
        starts_in_a_round(
            start_worker, redis_client, f"{queue}-off-{n}", {"EXPLICIT_SERVER_CLOCK": "0"}
        )
        for n in range(ROUNDS)
    ]
    print(f"handler starts per round: server clock {kept}, host clock {control}")
    assert kept == [1] * ROUNDS
    assert all(starts >= 2 for starts in control), control
