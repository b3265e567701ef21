"""The broker down for a long outage (SIGKILL, started again on the same data after the
outage) under steady business writes through the outbox: a Redis on its append-only
file (``redis``), or a RabbitMQ node whose queues are quorum queues, its publishers
waiting for confirms, on its database (``rabbitmq-quorum``).

Must hold: every business commit succeeds during the outage (the broker is not the
business's dependency), the outbox backlog drains after it, every committed job's
effect is applied (0 lost) once (0 duplicates). Negative control, written in the same
loop through the same outage: ``dispatch(durable=False)``, the publish after commit;
it fails while the broker is down, is logged, and the job is lost (its row stays).
"""

from __future__ import annotations

import random
import time

import pytest
from kombu import Connection
from prometheus_client import REGISTRY

from tests.chaos import history
from tests.chaos.business_writes import BROKERS, outbox_rig
from tests.chaos.report import Row, scaled
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(scaled(240, 900)),
]

OUTAGE = scaled(6, 60)  # seconds the broker is down
BEFORE = 2.0  # seconds of writes before the outage, and after it
PACE = (0.02, 0.05)  # seconds between two writes of each producer
# Generous: after a long outage a relay's backoff (cap 30 s, full jitter) and a
# worker's reconnect (kombu: 2, 4, ... up to 30 s apart) both wait before trying again.
SETTLE = 120.0


def publish_failures() -> float:
    """dispatch()'s count of on_commit publishes that failed (each one a lost job)."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "explicit_dispatch_publish_failed"
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels.get("task") == "chaos.job"
    )


FAULTS = {
    "redis": f"broker Redis (appendonly) down {OUTAGE} s (SIGKILL)",
    "rabbitmq-quorum": "broker RabbitMQ node (quorum queues, publisher confirms) SIGKILLed, "
    f"started again on its database after {OUTAGE} s (and its boot)",
}


@pytest.mark.parametrize("broker", BROKERS)
def test_broker_down_under_steady_writes(
    start_worker, start_relay, queue, run_id, tmp_path, broker
) -> None:
    started = time.monotonic()
    with outbox_rig(
        start_worker,
        start_relay,
        run=run_id,
        queue=queue,
        tmp_path=tmp_path,
        control_path="on_commit",
        relay_args=("--batch-size", "50", "--poll-interval", "0.2"),
        broker=broker,
    ) as rig:
        outbox, control, backlog = rig.outbox, rig.control, rig.backlog
        rng = random.Random(run_id)

        def write_for(seconds: float) -> None:
            # Both producers in one loop: they meet the same outage.
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                outbox.write()
                control.write()
                backlog.sample()
                time.sleep(rng.uniform(*PACE))

        failed_before = publish_failures()
        write_for(BEFORE)
        rig.broker.kill()
        down_at = time.monotonic()
        write_for(OUTAGE)
        rig.broker.start(timeout=60)
        outage = time.monotonic() - down_at
        backlog.broker_back(outbox.attempted)
        write_for(BEFORE)
        try:
            wait_for(
                lambda: backlog.settled(outbox),
                timeout=SETTLE,
                interval=0.2,
                what="the backlog applied",
            )
            drained = True
        except TimeoutError:
            drained = False
        # The control's published jobs applied too, and late redeliveries counted.
        time.sleep(3.0)
        rig.workers.stop()
        assert [r.stop() for r in rig.relays] == [0, 0]
        counts = history.check(outbox.run)
        # For a failing run: which jobs, to find their messages in the broker's AOF.
        lost_jobs = history.lost_jobs(outbox.run)[:10]
        missed = history.check(control.run)
        failed = int(publish_failures() - failed_before)
        workers = rig.workers
        if broker == "rabbitmq-quorum":
            # What the workers consumed from: RabbitMQ accepts this declare of an
            # existing queue only if it is a quorum queue.
            with Connection(rig.broker.url) as conn:
                channel = conn.channel()
                channel.queue_declare(queue, passive=True)
                channel.queue_declare(
                    queue, durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"}
                )

    row = Row(
        # The Redis run keeps the name its earlier results are under (rows are keyed by it).
        scenario="broker outage" if broker == "redis" else f"broker outage ({broker})",
        fault=f"{FAULTS[broker]} under steady writes through the outbox, one every 20-50 ms",
        faults=1,
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures={
            "outage (s)": round(outage, 1),
            "commits failed": len(outbox.commit_errors),
            "outbox backlog peak": backlog.peak,
            "backlog relayed after broker back (s)": _rounded(backlog.relayed_after),
            "its jobs applied after broker back (s)": _rounded(backlog.applied_after),
            "dead-lettered": counts.dead_lettered,
            "lost jobs": lost_jobs or "-",
            "worker crashes (restarted)": workers.crashes,
        },
        holds=not outbox.commit_errors
        and outbox.committed() == outbox.attempted
        and counts.jobs == outbox.attempted
        and counts.lost == 0
        and counts.duplicates == 0
        and counts.done == counts.jobs
        and drained,
        control=f"dispatch on_commit: {missed.lost} of {missed.jobs} committed rows without "
        f"their job ({failed} failed publishes logged)",
        control_failed=missed.lost > 0
        and not control.commit_errors
        and control.committed() == control.attempted,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, (row, outbox.commit_errors[:3], control.commit_errors[:3])


def _rounded(seconds: float | None) -> float | str:
    return "never" if seconds is None else round(seconds, 1)
