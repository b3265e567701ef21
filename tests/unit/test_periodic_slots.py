"""The published slots in the database: a gap is reported (W016), and ``explain`` says
which slot a job ran for."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from celery_explicit import periodic
from django_outbox.checks.periodic import check_missed_slots
from django_outbox.incident.explain import explain
from django_outbox.models import Attempt, Outcome, PeriodicSlot
from django_outbox.store import periodic_slots

pytestmark = pytest.mark.django_db


def publish(entry: str, slot: dt.datetime, grid: str = "every 60s") -> str:
    task_id = str(uuid.uuid4())
    periodic_slots.record(
        entry=entry,
        slot=slot,
        task_name="tests.slot_report",
        task_id=task_id,
        idempotency_key=f"slotreport:x:{periodic.format_slot(slot)}",
        published_by="beat-host:42",
        grid=grid,
    )
    return task_id


def test_a_slot_no_beat_published_is_reported() -> None:
    entry = f"report-{uuid.uuid4().hex[:6]}"
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    for minutes_ago in (10, 9, 8, 5, 4):  # 7 and 6 minutes ago: every beat was down
        publish(entry, now - dt.timedelta(minutes=minutes_ago))
    publish(entry, now - dt.timedelta(minutes=4))  # the other beat's record: ignored
    [gap] = [gap for gap in periodic_slots.missing(now=now, grace=120) if gap.entry == entry]
    # 3, 2 minutes ago: missing too (nobody published since); 1 minute ago: within grace.
    assert gap.slots == [now - dt.timedelta(minutes=m) for m in (7, 6, 3, 2)]
    assert gap.grid == "every 60s"
    [warning] = [w for w in check_missed_slots(databases=["default"]) if w.obj == entry]
    assert warning.id == "django_outbox.W016"
    assert periodic.format_slot(now - dt.timedelta(minutes=7)) in warning.msg
    assert "4 slot(s)" in warning.msg
    # Without --database the check reads nothing (as Django's database checks).
    assert check_missed_slots() == []


def test_an_entry_published_in_every_slot_has_no_gap() -> None:
    entry = f"hourly-{uuid.uuid4().hex[:6]}"
    now = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0)
    for hours_ago in (3, 2, 1, 0):
        publish(entry, now - dt.timedelta(hours=hours_ago), grid="crontab 0 * * * * UTC")
    gaps = periodic_slots.missing(now=now + dt.timedelta(minutes=30))
    assert [gap for gap in gaps if gap.entry == entry] == []
    assert PeriodicSlot.objects.filter(entry=entry).count() == 4


def test_explain_says_which_slot_a_job_ran_for() -> None:
    entry = f"report-{uuid.uuid4().hex[:6]}"
    slot = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    task_id = publish(entry, slot)
    key = f"slotreport:x:{periodic.format_slot(slot)}"
    Attempt.objects.create(
        task_id=task_id,
        task_name="tests.slot_report",
        idempotency_key=key,
        attempt=1,
        started_at=slot,
        finished_at=slot,
        duration_ms=1.0,
        outcome=Outcome.SUCCEEDED,
    )
    [explanation] = explain(key)
    [line] = [event.text for event in explanation.events if event.kind == "slot"]
    assert f"for slot {periodic.format_slot(slot)} of periodic entry {entry!r}" in line
    assert "beat beat-host:42" in line


def test_rows_older_than_a_week_are_pruned_once_an_hour_per_entry(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    entry = f"report-{uuid.uuid4().hex[:6]}"
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    week_ago = now - dt.timedelta(days=8)
    publish(entry, week_ago)
    publish(entry, now)  # this process's first publish of the entry prunes
    assert not PeriodicSlot.objects.filter(entry=entry, slot=week_ago).exists()
    publish(entry, week_ago - dt.timedelta(minutes=1))
    publish(entry, now - dt.timedelta(minutes=1))  # within the hour: not again
    assert (
        PeriodicSlot.objects.filter(entry=entry, slot__lt=now - dt.timedelta(days=7)).count() == 1
    )
    monkeypatch.setattr(periodic_slots, "PRUNE_EVERY", 0.0)
    publish(entry, now - dt.timedelta(minutes=2))
    assert not PeriodicSlot.objects.filter(
        entry=entry, slot__lt=now - dt.timedelta(days=7)
    ).exists()
