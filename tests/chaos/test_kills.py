"""SIGKILL a pool child or a whole worker mid-task, many times, on Redis and on
RabbitMQ, with the broker backstop the docs recommend (3,600 s).

Must hold: 0 lost, 0 duplicate effects, every job done within its own visibility
timeout of the last kill plus a worker's restart and the backlog's work (``bound``: a
killed pool child's job is requeued behind the backlog, as kombu's reject puts it). A
job not done by then is waited for as long again, so the report tells late from lost.
Negative control: the same storm through a task without the ledger applies some
effects twice.

``redis-sentinel``: the state store (execution leases, delivery counts) behind a
private primary, replica and three Sentinels, and halfway through the kills a failover
that loses what the primary wrote in its last second (replication severed, the primary
SIGKILLed, the Sentinels promote the replica): the leases of the jobs running then are
gone. The same must hold, and the state store must answer again within
``FAILOVER_BOUND`` of the primary's death.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from celery_explicit import redis_state
from django_outbox import broker_queues
from tests.chaos import history
from tests.chaos.report import Row, scaled
from tests.chaos.tasks import ChaosJob, chaos_job_unguarded
from tests.conftest import RABBITMQ_URL
from tests.support.cluster import PrivateCluster
from tests.support.sentinel import SentinelGroup
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
#: Kill of the primary to the state store answering on the promoted replica: Sentinel's
#: detection (500 ms) and election, with room for a machine busy with the storm.
FAILOVER_BOUND = 15.0
#: How long the replication link loses the primary's writes before it dies.
SEVERED = 1.0
#: The hold after its effect of the jobs that span the failover.
LONG = 3.0
#: Every LONG_EVERY-th job holds LONG: enough of them run when the failover comes.
LONG_EVERY = scaled(10, 40)
#: The storm's pool slots: two workers of two children.
SLOTS = 4


class Failover:
    """The state store's failover, started once, halfway through the kills."""

    def __init__(self, group: SentinelGroup, progress: Callable[[], int]) -> None:
        self.group = group
        self.progress = progress
        self.outage: float | None = None
        #: Jobs done when the primary died: the failover came mid-stream.
        self.done_at_kill = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.group.sever()
        time.sleep(SEVERED)
        self.group.kill_primary()
        self.done_at_kill = self.progress()
        self._thread = threading.Thread(target=self._measure, args=(time.monotonic(),))
        self._thread.start()

    def _measure(self, killed: float) -> None:
        client = None
        while time.monotonic() - killed < 60:
            try:
                # Made as the workers make theirs; it connects at once, so in the loop.
                client = client or redis_state.new_client(self.group.url, keep_one=True)
                promoted = self.group.master_port() == self.group.replica.port
                if promoted and client.set("failover:probe", "1", ex=60):
                    self.outage = time.monotonic() - killed
                    return
            except Exception:  # anything but an answer is the outage
                pass
            time.sleep(0.05)

    def join(self) -> float:
        assert self._thread is not None, "the failover never started"
        self._thread.join()
        return self.outage if self.outage is not None else float("inf")


def bound(long_every: int) -> float:
    """Seconds after the last kill by which every job must be done: a lease, a worker's
    restart, and the storm's work spread over its slots (a killed pool child's job is
    requeued at the back of its queue, behind the backlog): each job's two holds, and
    the extra hold of the long ones."""
    work = JOBS * 2 * HOLD + (JOBS // long_every * (LONG - HOLD) if long_every else 0.0)
    return ChaosJob.visibility_timeout + RESTART + 2 * work / SLOTS


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
    halfway: Callable[[], None] | None = None,
    long_every: int = 0,
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
    started = list(workers)
    history.record_published(run, range(JOBS))
    with Connection(broker, transport_options={"confirm_publish": quorum}) as conn:
        for job in range(JOBS):
            # Half the hold before the effect, half after it: a kill then lands
            # between the commit and the ack, where a redelivery would apply it again.
            # Every ``long_every``-th job runs LONG after its effect: it spans a failover.
            tail = LONG if long_every and job % long_every == 0 else after
            task.apply_async(
                kwargs={"run": run, "job": job, "hold": before, "after": tail},
                queue=target,
                connection=conn,
            )
    rng = random.Random(run)
    kills = {"child": 0, "worker": 0}
    last_kill = time.monotonic()
    while sum(kills.values()) < kills_wanted and history.done_count(run) < JOBS:
        time.sleep(rng.uniform(0.05, 0.3))
        if halfway is not None and sum(kills.values()) == kills_wanted // 2:
            halfway()
            halfway = None
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
            started.append(workers[-1])
        last_kill = time.monotonic()
    deadline = bound(long_every)
    late = 0
    try:
        wait_for(lambda: history.done_count(run) >= JOBS, timeout=deadline, interval=0.5)
        recovered = time.monotonic() - last_kill
    except TimeoutError:
        recovered = float("inf")
        # Past the bound: late, or lost? As long again before a job is called lost.
        missing = JOBS - history.done_count(run)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: history.done_count(run) >= JOBS, timeout=deadline, interval=0.5)
        late = missing - (JOBS - history.done_count(run))
    # Let late redeliveries land before counting duplicates.
    time.sleep(2.0)
    return {
        "kills": kills,
        "recovered": recovered,
        "bound": deadline,
        "late": late,
        "counts": history.check(run),
        "duplicates": history.duplicate_detail(run),
        "lost": history.lost_jobs(run)[:10],
        # Executions that ended after a failover had lost their lease's record.
        "records_lost": sum(w.log().count("was gone at its release") for w in started),
        "unreleased": sum(w.log().count("could not release the execution lease") for w in started),
    }


@pytest.mark.parametrize(
    "broker_name", ["redis", "redis-cluster", "redis-sentinel", "rabbitmq", "rabbitmq-quorum"]
)
def test_kill_storm(start_worker, queue, run_id, broker_name, redis_client, tmp_path) -> None:
    from django.conf import settings

    broker = RABBITMQ_URL if broker_name.startswith("rabbitmq") else settings.REDIS_URL
    quorum = broker_name == "rabbitmq-quorum"
    # redis-cluster, redis-sentinel: the broker is the Redis of the other runs; the
    # state store (the execution leases, the delivery counts) a private three-node
    # Redis Cluster, or a private primary and replica behind Sentinels.
    cluster = PrivateCluster(tmp_path / "cluster") if broker_name == "redis-cluster" else None
    group = SentinelGroup(tmp_path / "sentinel") if broker_name == "redis-sentinel" else None
    failover = Failover(group, lambda: history.done_count(run_id)) if group else None
    state_url = cluster.url if cluster else group.url if group else None
    started = time.monotonic()
    try:
        result = storm(
            start_worker,
            ChaosJob(),
            run_id,
            queue,
            broker,
            quorum=quorum,
            state_url=state_url,
            halfway=failover.start if failover else None,
            long_every=LONG_EVERY if failover else 0,
        )
        outage = failover.join() if failover else None
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
        if group is not None:
            group.stop()
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
    figures = {
        "child kills": result["kills"]["child"],
        "worker kills": result["kills"]["worker"],
        "all done after last kill (s)": round(result["recovered"], 1),
    }
    if result["late"]:
        figures["done only after the bound"] = result["late"]
    if outage is not None:
        figures["state store outage in the failover (s)"] = round(outage, 1)
        figures["executions whose lease record was lost"] = result["records_lost"]
        figures["executions that ended in the outage"] = result["unreleased"]
        assert failover is not None
        figures["jobs done when the primary died"] = failover.done_at_kill
    row = Row(
        scenario=f"kills ({broker_name})",
        fault="SIGKILL a pool child (75%) or a whole worker, mid-task; backstop 3,600 s"
        + ("; a state-store failover halfway, its last second lost" if group else ""),
        faults=sum(result["kills"].values()) + (1 if group else 0),
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures=figures,
        holds=counts.lost == 0
        and counts.duplicates == 0
        and counts.done == JOBS
        and result["recovered"] <= result["bound"]
        and (outage is None or outage <= FAILOVER_BOUND),
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
    if broker_name.startswith("rabbitmq") or broker_name == "redis-cluster":
        with Connection(broker) as conn:
            conn.channel().queue_delete(queue)


def queue_type(queue: str) -> str:
    """The queue's type as RabbitMQ's management API reports it (read as the dashboard
    reads a queue's figures)."""
    with Connection(RABBITMQ_URL) as conn:
        info, why = broker_queues._rabbitmq_queue_info(conn, queue)
    assert info is not None, why
    return str(info["type"])
