"""Rolling deploys under a steady stream of jobs, on Redis and on RabbitMQ.

Three workers (``-c 2``) serve one queue; jobs run 1.5-6 s against a 3 s lease (only the
heartbeat keeps most of them). Every few seconds the oldest worker gets SIGTERM (a
warm shutdown: it finishes what it runs) and a new one starts, as a deploy replaces
workers one by one. Must hold: 0 lost, 0 duplicate effects, and no job's handler
started twice (the draining worker keeps its running jobs' leases, and gives back at
once what it prefetched but never started). Negative control (Redis): the same deploys
with the drain's heartbeat off (``EXPLICIT_DRAIN_HEARTBEAT=0``) start jobs twice. On
RabbitMQ the draining worker's open connection keeps its deliveries, so the control
cannot show a second start there (tests/fault/test_deploys.py measures it): its row has
none.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

import pytest
from kombu import Connection

from tests.chaos import history
from tests.chaos.report import Row, scaled
from tests.chaos.tasks_deploys import DeployJob, starts_key
from tests.conftest import RABBITMQ_URL
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(scaled(600, 3600)),
]

JOBS = scaled(60, 600)
DEPLOYS = scaled(6, 40)  # workers replaced, one at a time
GAP = (3.0, 5.0)  # seconds between two replacements
HOLD = (1.5, 6.0)  # a job's run before its effect
WORKERS = 3


def rolling_deploys(
    start_worker: Any, redis_client: Any, run: str, queue: str, broker: str, env: dict[str, str]
) -> dict[str, Any]:
    env = {**env, "EXPLICIT_TEST_BROKER_URL": broker}
    workers = [start_worker(queue=queue, concurrency=2, extra_env=env) for _ in range(WORKERS)]
    rng = random.Random(run)
    holds = [round(rng.uniform(*HOLD), 2) for _ in range(JOBS)]
    history.record_published(run, range(JOBS))
    # The jobs go out over the deploys: every replacement finds jobs running and waiting.
    span = DEPLOYS * sum(GAP) / 2

    def publish() -> None:
        with Connection(broker) as conn:
            for job in range(JOBS):
                time.sleep(max(0.0, begun + job * span / JOBS - time.monotonic()))
                DeployJob().apply_async(
                    kwargs={"run": run, "job": job, "hold": holds[job]},
                    queue=queue,
                    connection=conn,
                )

    begun = time.monotonic()
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    draining = []
    for _ in range(DEPLOYS):
        time.sleep(rng.uniform(*GAP))
        oldest = workers.pop(0)
        oldest.process.send_signal(signal.SIGTERM)  # warm shutdown: it drains on its own
        draining.append(oldest)
        workers.append(start_worker(queue=queue, concurrency=2, extra_env=env))
    publisher.join()
    wait_for(
        lambda: history.done_count(run) >= JOBS,
        timeout=60 + JOBS * max(HOLD) / (2 * WORKERS),
        interval=0.5,
        what="every job done",
    )
    for worker in draining:
        worker.process.wait(timeout=60)  # each drained and exited by itself
    time.sleep(2.0)  # a late second start would land now
    starts = [int(redis_client.get(starts_key(run, job)) or 0) for job in range(JOBS)]
    return {
        "counts": history.check(run),
        "twice": sum(1 for n in starts if n > 1),
        "longer than the lease": sum(1 for hold in holds if hold > DeployJob.visibility_timeout),
        "exited cleanly": sum(1 for w in draining if w.process.returncode == 0),
    }


@pytest.mark.parametrize("broker_name", ["redis", "rabbitmq"])
def test_rolling_deploys(start_worker, redis_client, queue, run_id, broker_name) -> None:
    from django.conf import settings

    broker = settings.REDIS_URL if broker_name == "redis" else RABBITMQ_URL
    started = time.monotonic()
    result = rolling_deploys(start_worker, redis_client, run_id, queue, broker, {})
    counts = result["counts"]
    control_text, control_failed = "- (RabbitMQ keeps a draining worker's deliveries)", True
    if broker_name == "redis":
        control = rolling_deploys(
            start_worker,
            redis_client,
            run_id + "c",
            f"{queue}-c",
            broker,
            {"EXPLICIT_DRAIN_HEARTBEAT": "0"},
        )
        control_text = f"drain heartbeat off: {control['twice']} jobs started twice"
        control_failed = control["twice"] > 0
    row = Row(
        scenario=f"rolling deploys ({broker_name})",
        fault=f"rolling deploy: SIGTERM the oldest of {WORKERS} workers every "
        f"{GAP[0]:g}-{GAP[1]:g} s, a new one started",
        faults=DEPLOYS,
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures={
            "jobs started twice": result["twice"],
            "jobs longer than their lease": result["longer than the lease"],
            "workers that drained and exited 0": result["exited cleanly"],
        },
        holds=counts.lost == 0
        and counts.duplicates == 0
        and counts.done == JOBS
        and result["twice"] == 0,
        control=control_text,
        control_failed=control_failed,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, (row, history.lost_jobs(run_id)[:10])
    if broker_name == "rabbitmq":
        with Connection(broker) as conn:
            conn.channel().queue_delete(queue)
