"""The broker's Redis restarted (SIGKILL or SIGTERM, then started again on the same
append-only file) several times while producers write through the outbox.

Must hold: every committed business row has its job's effect (0 lost), applied once
(0 duplicates). Negative control, written in the same loop through the same restarts:
the business row committed, then a bare ``apply_async`` whose failure is logged and
ignored. Append-only keeps what Redis held across a restart, so what that control
loses is what it tried to publish while Redis was down.

kombu's Redis transport takes a message with BRPOP and records it in ``unacked`` with
a second command; a restart between the two keeps the pop (the append-only file has
the job's LPUSH, then an RPOP as the last command before the restart, and no HSET of
its delivery tag ever) and the message is gone: about one job in five restarts when
nothing reconciles. The outbox had marked it published; the relay's
reconciliation (``django_outbox.outbox.relay.reconcile``, here after ``RECONCILE_AFTER`` seconds)
finds no worker's trace of it, sees its queue has moved past it, and publishes it
again. The row's figure "published again" counts those.

A figure, not an invariant: the same broker *without* persistence loses on one restart
every message it held (the relay had marked them published; reconciliation would bring
them back after its default 300 s, which this figure does not wait for).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from django_outbox.models import OutboxEvent
from tests.chaos import history
from tests.chaos.business_writes import Backlog, Producer, outbox_rig
from tests.chaos.report import Row, scaled
from tests.support.servers import PrivateRedis
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(scaled(240, 900)),
]

RESTARTS = scaled(2, 5)
UP = (1.5, 3.0)  # seconds between restarts: the broker serves, producers write
DOWN = (1.0, 2.5)  # seconds each restart leaves the broker down
TAIL = 1.0  # seconds of writes after the last restart
PACE = (0.02, 0.05)  # seconds between two writes of each producer
SETTLE = 90.0  # generous: a worker's reconnect backs off up to 30 s (kombu)
VOLATILE_JOBS = scaled(50, 200)
#: Seconds before a relay publishes again an event no worker received (django_outbox.
#: reconcile): short, so the job a restart lost comes back within SETTLE.
RECONCILE_AFTER = 5.0


class Restarts(threading.Thread):
    """Restarts the broker ``RESTARTS`` times, alternating SIGKILL and SIGTERM, while the
    test's main thread keeps writing."""

    def __init__(self, broker: PrivateRedis, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.broker = broker
        self.rng = rng
        self.done = 0
        self.down_seconds = 0.0
        self.last_back: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for i in range(RESTARTS):
                time.sleep(self.rng.uniform(*UP))
                went_down = time.monotonic()
                self.broker.kill() if i % 2 == 0 else self.broker.stop()
                time.sleep(self.rng.uniform(*DOWN))
                self.broker.start(timeout=30)
                self.last_back = time.monotonic()
                self.down_seconds += self.last_back - went_down
                self.done += 1
        except BaseException as exc:  # re-raised by the test's thread
            self.error = exc


def test_broker_restarts_under_the_outbox(
    start_worker, start_relay, queue, run_id, tmp_path
) -> None:
    started = time.monotonic()
    volatile: PrivateRedis | None = None
    try:
        with outbox_rig(
            start_worker,
            start_relay,
            run=run_id,
            queue=queue,
            tmp_path=tmp_path,
            control_path="after_commit",
            relay_args=(
                "--batch-size",
                "20",
                "--poll-interval",
                "0.2",
                "--reconcile-after",
                str(RECONCILE_AFTER),
            ),
        ) as rig:
            outbox, control, backlog = rig.outbox, rig.control, rig.backlog
            rng = random.Random(run_id)
            restarts = Restarts(rig.broker, random.Random(run_id + "r"))
            restarts.start()
            # Both producers write in the same loop: they meet the same restarts.
            tail_end: float | None = None
            while tail_end is None or time.monotonic() < tail_end:
                outbox.write()
                control.write()
                backlog.sample()
                if tail_end is None and not restarts.is_alive():
                    tail_end = time.monotonic() + TAIL
                    # Drain times count from the last restart, for the jobs written
                    # before it.
                    backlog.broker_back(outbox.attempted, at=restarts.last_back)
                time.sleep(rng.uniform(*PACE))
            restarts.join()
            if restarts.error is not None:
                raise restarts.error

            settled = settle(outbox, control, backlog)
            republished = sum(OutboxEvent.objects.values_list("republished", flat=True))
            rig.workers.stop()
            workers = rig.workers
            counts = history.check(outbox.run)
            # For a failing run: which jobs, to find their messages in the broker's AOF.
            lost_jobs = history.lost_jobs(outbox.run)[:10]
            missed = history.check(control.run)
            # Relay backlog gone: the rest of the test reuses the outbox table.
            assert [r.stop() for r in rig.relays] == [0, 0]

        volatile = PrivateRedis(tmp_path / "volatile", durable=False).start()
        held, kept = restart_without_persistence(volatile, start_relay, queue, run_id + "v")
    finally:
        if volatile is not None:
            volatile.kill()

    row = Row(
        scenario="broker restarts",
        fault="broker Redis (appendonly, fsync always) restarted: SIGKILL / SIGTERM in turn, "
        "down 1-2.5 s each, producers writing through the outbox",
        faults=restarts.done,
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures={
            "broker down in all (s)": round(restarts.down_seconds, 1),
            "outbox backlog peak": backlog.peak,
            "relayed after last restart (s)": _rounded(backlog.relayed_after),
            "all applied after last restart (s)": _rounded(backlog.applied_after),
            "dead-lettered": counts.dead_lettered,
            "lost jobs": lost_jobs or "-",
            "published again (reconcile)": republished,
            "worker crashes (restarted)": workers.crashes,
            "no appendonly, 1 SIGKILL restart: messages kept": f"{kept} of {held}",
        },
        holds=not outbox.commit_errors
        and outbox.committed() == outbox.attempted
        and counts.jobs == outbox.attempted
        and counts.lost == 0
        and counts.duplicates == 0
        and counts.done == counts.jobs
        and settled,
        control=f"apply_async after commit: {missed.lost} of {missed.jobs} committed rows "
        f"without their job ({control.publish_errors} publish errors logged)",
        control_failed=missed.lost > 0 and not control.commit_errors,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.control_failed, row
    assert row.holds, (row, lost_jobs)


def settle(outbox: Producer, control: Producer, backlog: Backlog) -> bool:
    """Wait until the outbox is empty and every outbox job was applied (False if that
    never happened: the checker then counts the lost); then until the control's jobs
    stop being applied (the same queue, interleaved: a few seconds), for late
    redeliveries to show as duplicates too. The control is not awaited to a count: it
    may lose more than its failed publishes (the window described above)."""

    try:
        wait_for(
            lambda: backlog.settled(outbox),
            timeout=SETTLE,
            interval=0.2,
            what="the backlog applied",
        )
        done = True
    except TimeoutError:
        done = False
    quiet_since, seen = time.monotonic(), history.done_count(control.run)
    deadline = time.monotonic() + 30.0
    while time.monotonic() - quiet_since < 3.0 and time.monotonic() < deadline:
        time.sleep(0.5)
        now = history.done_count(control.run)
        if now != seen:
            quiet_since, seen = time.monotonic(), now
    return done


def restart_without_persistence(
    volatile: PrivateRedis, start_relay: Any, queue: str, run: str
) -> tuple[int, int]:
    """Relay ``VOLATILE_JOBS`` outbox jobs into a Redis without appendonly (and no RDB
    snapshot), with no worker reading, SIGKILL it, start it again: how many of the
    messages it held came back. The outbox has marked them all published by then."""
    relay = start_relay("--batch-size", "20", "--poll-interval", "0.2", broker_url=volatile.url)
    writer = Producer(run, queue, volatile.url, "outbox")
    for _ in range(VOLATILE_JOBS):
        writer.write()
    wait_for(lambda: not OutboxEvent.objects.pending().exists(), timeout=30, what="all relayed")
    client = volatile.client()
    try:
        held = int(client.llen(queue))
    finally:
        client.close()
    volatile.kill()
    volatile.start(timeout=30)
    client = volatile.client()
    try:
        kept = int(client.llen(queue))
    finally:
        client.close()
    relay.stop()
    return held, kept


def _rounded(seconds: float | None) -> float | str:
    return "never" if seconds is None else round(seconds, 1)
