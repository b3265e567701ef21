"""Throughput while a pool child is SIGKILLed every 2 s, against a clean run of the
same workload on the same workers, side by side (clean, killed, clean; the machine's
load drifts). Target: at least 0.7 of the clean run, judged at full scale. Also counted:
0 lost, 0 duplicate effects under the kills."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from tests.chaos import history
from tests.chaos.report import SCALE, Row, scaled
from tests.chaos.tasks import ChaosJob
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(scaled(300, 1800)),
]

JOBS = scaled(300, 3000)
EVERY = 2.0


def one_run(run: str, queue: str, workers: list, *, kill: bool) -> tuple[float, int]:  # type: ignore[type-arg]
    history.record_published(run, range(JOBS))
    stop = threading.Event()
    kills = [0]

    def killer() -> None:
        rng = random.Random(run)
        while not stop.wait(EVERY):
            children = [pid for w in workers for pid in w.child_pids()]
            if children:
                try:
                    os.kill(rng.choice(children), signal.SIGKILL)
                    kills[0] += 1
                except ProcessLookupError:
                    pass

    started = time.monotonic()
    for job in range(JOBS):
        ChaosJob().apply_async(kwargs={"run": run, "job": job, "hold": 0.02}, queue=queue)
    thread = threading.Thread(target=killer, daemon=True)
    if kill:
        thread.start()
    try:
        wait_for(lambda: history.done_count(run) >= JOBS, timeout=120 + JOBS * 0.1, interval=0.2)
    finally:
        stop.set()
    return JOBS / (time.monotonic() - started), kills[0]


def test_throughput_under_kills(start_worker, queue, run_id) -> None:
    started = time.monotonic()
    workers = [start_worker(concurrency=2) for _ in range(2)]
    clean_a, _ = one_run(run_id + "a", queue, workers, kill=False)
    killed, kills = one_run(run_id, queue, workers, kill=True)
    clean_b, _ = one_run(run_id + "b", queue, workers, kill=False)
    time.sleep(2.0)  # late redeliveries land before duplicates are counted
    counts = history.check(run_id)
    ratio = killed / ((clean_a + clean_b) / 2)
    row = Row(
        scenario="throughput under kills",
        fault=f"SIGKILL a pool child every {EVERY:g} s",
        faults=kills,
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures={
            "jobs/s clean": f"{clean_a:.0f}, {clean_b:.0f}",
            "jobs/s under kills": f"{killed:.0f}",
            "ratio": round(ratio, 2),
        },
        # The 0.7 target is judged at full scale, as the poison messages' is: a short run
        # lasts seconds and meets one or two kills, each a pool child's restart, so its
        # ratio swings by more than the margin (0.62 to 1.04 seen). Reported either way;
        # no effect lost or doubled at any scale.
        holds=counts.lost == 0 and counts.duplicates == 0 and (SCALE != "full" or ratio >= 0.7),
        control="-",
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, row
