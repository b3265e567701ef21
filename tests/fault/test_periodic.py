"""Fault tests: two beats running at once publish each schedule slot once, with real
``celery beat`` processes and a real worker.

An entry runs every second; two beats run it for a few seconds (each with its own
schedule file, as two hosts would), and the worker notes the slot of every message it
runs. With our scheduler each slot ran once, every slot between the first and the last
was published (no gap for W016), and the other beat's copies are attempts recorded
``deduplicated``. Negative control: Celery's own scheduler, in the same set-up, runs the
entry twice a second. The same with django-celery-beat's DatabaseScheduler, two beats on
one database.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import time
import uuid
from pathlib import Path

import pytest

from celery_explicit import periodic
from django_outbox.models import Attempt, Outcome, PeriodicSlot
from django_outbox.store import periodic_slots
from tests.support.beats import Beat
from tests.support.scale import scaled
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

#: Seconds both beats run side by side (a slot a second): short in the suite, a minute
#: under scripts/chaos.
RUN_FOR = float(scaled(6, 60))

SCHEDULERS = {
    "explicit": "celery_explicit.beat:PersistentScheduler",
    "celery": "celery.beat:PersistentScheduler",
    "database": "celery_explicit.beat_database:DatabaseScheduler",
    "plain_database": "django_celery_beat.schedulers:DatabaseScheduler",
}


def run_two_beats(scheduler: str, queue: str, tmp_path: Path, env: dict[str, str]) -> None:
    from django.db import connection

    db_name = connection.settings_dict["NAME"]
    beats = [
        Beat(scheduler=scheduler, queue=queue, db_name=db_name, log_dir=tmp_path, extra_env=env)
        for _ in range(2)
    ]
    try:
        for beat in beats:
            beat.wait_ready(timeout=30)
        time.sleep(RUN_FOR)
    finally:
        for beat in beats:
            beat.stop()


def runs_of(redis_client, tag: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [item.decode() for item in redis_client.lrange(f"slots:{tag}", 0, -1)]


def wait_for_the_queue(redis_client, queue: str, tag: str) -> list[str]:  # type: ignore[no-untyped-def]
    wait_for(lambda: redis_client.llen(queue) == 0, timeout=30, what="the queue drained")
    time.sleep(1.0)  # the last message taken is run and noted
    return runs_of(redis_client, tag)


def assert_each_slot_once(runs: list[str], tag: str) -> None:
    counts = collections.Counter(runs)
    assert len(counts) >= RUN_FOR - 2, runs
    assert max(counts.values()) == 1, counts  # no slot ran twice
    published = list(PeriodicSlot.objects.filter(task_id__isnull=False, entry__endswith=tag))
    assert {periodic.format_slot(row.slot) for row in published} == set(counts)
    # Both beats were due in every slot: the second one's copy of each was dropped, and
    # recorded as a deduplicated attempt.
    dropped = Attempt.objects.filter(
        outcome=Outcome.DEDUPLICATED, idempotency_key__startswith=f"slotreport:{tag}:"
    )
    assert dropped.count() >= len(counts) - 2, (dropped.count(), len(counts))
    assert {a.idempotency_key.rsplit(":", 1)[1] for a in dropped} <= set(counts)
    # Between the first and the last slot none is missing (W016 finds no gap).
    last = max(periodic.slot_time(slot) for slot in counts)
    gaps = periodic_slots.missing(now=last + dt.timedelta(seconds=1), grace=1.0, window=600)
    assert [gap for gap in gaps if gap.entry.endswith(tag)] == []


@pytest.mark.parametrize("scheduler", ["explicit", "celery"], ids=["explicit", "control"])
def test_two_persistent_beats_publish_each_slot_once(
    start_worker, redis_client, queue: str, tmp_path: Path, scheduler: str
) -> None:
    tag = uuid.uuid4().hex[:10]
    start_worker(concurrency=2)
    started = time.monotonic()
    run_two_beats(SCHEDULERS[scheduler], queue, tmp_path, {"EXPLICIT_TEST_BEAT_TAG": tag})
    elapsed = time.monotonic() - started
    runs = wait_for_the_queue(redis_client, queue, tag)
    if scheduler == "explicit":
        assert_each_slot_once(runs, tag)
    else:
        # Celery's own: each beat runs the entry every second, so about two per second.
        assert runs and set(runs) == {"plain"}
        assert len(runs) >= 1.5 * (RUN_FOR - 1), (len(runs), elapsed)


@pytest.mark.parametrize("scheduler", ["database", "plain_database"], ids=["explicit", "control"])
def test_two_database_beats_publish_each_slot_once(
    start_worker, redis_client, queue: str, tmp_path: Path, scheduler: str
) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    tag = uuid.uuid4().hex[:10]
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=f"slot-report-{tag}",
        task="tests.slot_report",
        interval=every,
        kwargs=json.dumps({"tag": tag, "slot": "plain"}),
    )
    start_worker(concurrency=2)
    run_two_beats(SCHEDULERS[scheduler], queue, tmp_path, {})
    runs = wait_for_the_queue(redis_client, queue, tag)
    if scheduler == "database":
        assert_each_slot_once(runs, tag)
    else:
        # django-celery-beat's own: two beats on one database, two runs a second.
        assert runs and set(runs) == {"plain"}
        assert len(runs) >= 1.5 * (RUN_FOR - 1), len(runs)
