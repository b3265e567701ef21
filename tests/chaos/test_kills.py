"""SIGKILL a pool child or a whole worker mid-task, many times, on Redis and on
RabbitMQ, with the broker backstop the docs recommend (3,600 s).

Must hold: 0 lost, 0 duplicate effects, every job done within its own visibility
timeout of the last kill plus a worker's restart. Negative control: the same storm
through a task without the ledger applies some effects twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from django_outbox import broker_queues
from tests.chaos import history
from tests.chaos.report import Row, scaled
from tests.chaos.tasks import ChaosJob, chaos_job_unguarded
from tests.conftest import RABBITMQ_URL
from tests.support.cluster import PrivateCluster
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(scaled(300, 2400)),
]

JOBS = scaled(120, 2000)
KILLS = scaled(8, 100)
HOLD = 0.05  # each job runs this long: kills land mid-task
RESTART = 15.0  # seconds a killed worker's replacement may take to be ready


def storm(
    start_worker: Any,
    task: Any,
    run: str,
    queue: str,
    broker: str,
    *,
    before: float = HOLD,
    after: float = HOLD,
    kills_wanted: int = KILLS,
    whole_workers: bool = True,
    quorum: bool = False,
    state_url: str | None = None,
) -> dict[str, Any]:
    env = {"EXPLICIT_TEST_BROKER_URL": broker, "EXPLICIT_TEST_BACKSTOP": "3600"}
    if state_url:
        env["EXPLICIT_TEST_STATE_URL"] = state_url  # the workers' leases, on the cluster
    target: str | Queue = queue
    if quorum:
        env["EXPLICIT_TEST_QUEUE_TYPE"] = "quorum"
        # Declared as the workers declare it (a quorum queue refuses a classic declare).
        target = Queue(queue, Exchange(queue), queue, queue_arguments={"x-queue-type": "quorum"})
    workers = [start_worker(concurrency=2, extra_env=env) for _ in range(2)]
    history.record_published(run, range(JOBS))
    with Connection(broker, transport_options={"confirm_publish": quorum}) as conn:
        for job in range(JOBS):
            # Half the hold before the effect, half after it: a kill then lands
            # between the commit and the ack, where a redelivery would apply it again.
            task.apply_async(
                kwargs={"run": run, "job": job, "hold": before, "after": after},
                queue=target,
                connection=conn,
            )
    rng = random.Random(run)
    kills = {"child": 0, "worker": 0}
    last_kill = time.monotonic()
    while sum(kills.values()) < kills_wanted and history.done_count(run) < JOBS:
        time.sleep(rng.uniform(0.05, 0.3))
        live = [w for w in workers if w.alive()]
        victim = rng.choice(live)
        children = victim.child_pids()
        if (not whole_workers or rng.random() < 0.75) and children:
            # A pool child mid-task: the parent sees WorkerLostError and replaces it.
            try:
                os.kill(rng.choice(children), signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills["child"] += 1
        else:
            # The whole worker: nothing acks, nothing requeues; a new worker starts.
            victim.kill_group()
            kills["worker"] += 1
            workers.remove(victim)
            workers.append(start_worker(concurrency=2, extra_env=env))
        last_kill = time.monotonic()
    deadline = ChaosJob.visibility_timeout + RESTART + JOBS * HOLD
    try:
        wait_for(lambda: history.done_count(run) >= JOBS, timeout=deadline, interval=0.5)
        recovered = time.monotonic() - last_kill
    except TimeoutError:
        recovered = float("inf")
    # Let late redeliveries land before counting duplicates.
    time.sleep(2.0)
    return {
        "kills": kills,
        "recovered": recovered,
        "counts": history.check(run),
        "duplicates": history.duplicate_detail(run),
        "lost": history.lost_jobs(run)[:10],
    }


@pytest.mark.parametrize("broker_name", ["redis", "redis-cluster", "rabbitmq", "rabbitmq-quorum"])
def test_kill_storm(start_worker, queue, run_id, broker_name, redis_client, tmp_path) -> None:
    from django.conf import settings

    broker = RABBITMQ_URL if broker_name.startswith("rabbitmq") else settings.REDIS_URL
    quorum = broker_name == "rabbitmq-quorum"
    # redis-cluster: the broker is the Redis of the other runs; the state store (the
    # execution leases, the delivery counts) a private three-node Redis Cluster.
    cluster = PrivateCluster(tmp_path / "cluster") if broker_name == "redis-cluster" else None
    state_url = cluster.url if cluster else None
    started = time.monotonic()
    try:
        result = storm(
            start_worker, ChaosJob(), run_id, queue, broker, quorum=quorum, state_url=state_url
        )
        if cluster is not None:
            # The workers kept their state there: each job's execution lease was taken
            # and given back on it, a script call each (FCALL, or EVALSHA without
            # functions); nothing else calls a script on these nodes.
            calls = [
                sum(
                    int(stats["calls"])
                    for name, stats in n.client().info("commandstats").items()
                    if name in ("cmdstat_fcall", "cmdstat_evalsha")
                )
                for n in cluster.nodes
            ]
            assert sum(calls) >= 2 * JOBS, calls
    finally:
        if cluster is not None:
            cluster.stop()
    counts = result["counts"]
    # Most of the control's run time after its effect, and only pool children killed
    # (a whole worker's unguarded jobs would wait for the backstop, not run twice):
    # nearly every kill lands between the commit and the ack, where only a ledger
    # tells the redelivery, and the jobs last long enough for every kill to find one.
    control = storm(
        start_worker,
        chaos_job_unguarded,
        run_id + "c",
        queue,
        broker,
        before=0.01,
        after=0.3,
        kills_wanted=2 * KILLS,
        whole_workers=False,
        quorum=quorum,
    )
    row = Row(
        scenario=f"kills ({broker_name})",
        fault="SIGKILL a pool child (75%) or a whole worker, mid-task; backstop 3,600 s",
        faults=sum(result["kills"].values()),
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures={
            "child kills": result["kills"]["child"],
            "worker kills": result["kills"]["worker"],
            "all done after last kill (s)": round(result["recovered"], 1),
        },
        holds=counts.lost == 0
        and counts.duplicates == 0
        and counts.done == JOBS
        and result["recovered"] <= ChaosJob.visibility_timeout + RESTART + JOBS * HOLD,
        control=f"ledger off: {control['counts'].duplicates} duplicate effects",
        control_failed=control["counts"].duplicates > 0,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    if not row.ok:
        detail = {"duplicates": result["duplicates"], "lost": result["lost"]}
        Path(f"/tmp/chaos-{run_id}.json").write_text(json.dumps(detail, default=str, indent=1))
    assert row.ok, (row, result["duplicates"], result["lost"])
    if quorum:
        assert queue_type(queue) == "quorum"  # what the workers consumed from
    if broker_name != "redis":
        with Connection(broker) as conn:
            conn.channel().queue_delete(queue)


def queue_type(queue: str) -> str:
    """The queue's type as RabbitMQ's management API reports it (read as the dashboard
    reads a queue's figures)."""
    with Connection(RABBITMQ_URL) as conn:
        info, why = broker_queues._rabbitmq_queue_info(conn, queue)
    assert info is not None, why
    return str(info["type"])
