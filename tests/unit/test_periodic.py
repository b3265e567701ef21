"""Periodic tasks: the declaration, the slot of each kind of schedule, the claim in a
real Redis, and the W015 check."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from celery.schedules import crontab, schedule

from celery_explicit import ContractError, ExplicitTask, periodic

BASE: dict[str, Any] = {
    "name": "shop.daily_report",
    "idempotency_key": "report:{slot}",
    "visibility_timeout": 60,
    "expected_duration": 5,
    "retry_on": (),
    "fail_on": (),
}


def define(run: Any = None, **changes: Any) -> type[ExplicitTask]:
    def run_with_slot(self: Any, slot: str) -> None:
        return None

    body = {**BASE, **changes, "run": run or run_with_slot}
    return type("DailyReport", (ExplicitTask,), body)


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


# --- the declaration ---------------------------------------------------------------------


def test_a_periodic_task_keyed_by_its_slot_is_accepted() -> None:
    assert define(periodic=True).contract.periodic is True
    assert define().contract.periodic is False


def test_periodic_must_be_a_bool() -> None:
    with pytest.raises(ContractError) as caught:
        define(periodic="yes")
    assert caught.value.task_name == "shop.daily_report"
    assert caught.value.field == "periodic"
    assert "True or False" in str(caught.value)


def test_a_periodic_task_without_a_slot_parameter_is_refused_with_the_fix() -> None:
    def run(self: Any, region: str) -> None:
        return None

    with pytest.raises(ContractError) as caught:
        define(run=run, periodic=True, idempotency_key="report:{region}")
    message = str(caught.value)
    assert message.startswith("Task shop.daily_report:")
    assert caught.value.field == "periodic"
    assert "run(self, slot: str" in message and "{slot}" in message


def test_key_uses_slot() -> None:
    assert periodic.key_uses_slot("report:{region}:{slot}")
    assert periodic.key_uses_slot("report:{slot|sha256}")
    assert not periodic.key_uses_slot("report:{region}")
    assert periodic.key_uses_slot(lambda region, slot: f"{region}:{slot}")
    assert not periodic.key_uses_slot(lambda region: region)


# --- slots ------------------------------------------------------------------------------


def test_an_interval_slot_is_the_multiple_of_run_every_since_the_epoch() -> None:
    grid = periodic.grid_of(schedule(dt.timedelta(minutes=15)))
    assert grid.describe() == "every 900s"
    assert grid.slot_at(at("2025-06-01T10:14:59.999")) == at("2025-06-01T10:00:00")
    assert grid.slot_at(at("2025-06-01T10:15:00")) == at("2025-06-01T10:15:00")
    # Two beats started at different times agree: the slot is not counted from either.
    assert periodic.grid_of(schedule(1.0)).slot_at(at("2025-06-01T10:00:07.4")) == at(
        "2025-06-01T10:00:07"
    )


def test_a_crontab_slot_is_its_due_minute() -> None:
    grid = periodic.grid_of(crontab(minute="0,30", hour="*/2"))
    assert grid.describe() == "crontab 0,30 */2 * * * UTC"
    assert grid.slot_at(at("2025-06-01T10:29:59")) == at("2025-06-01T10:00:00")
    assert grid.slot_at(at("2025-06-01T11:59:00")) == at("2025-06-01T10:30:00")
    assert grid.period(at("2025-06-01T10:31:00")) == 5400.0  # 10:30 -> 12:00
    assert list(grid.slots_between(at("2025-06-01T07:00:00"), at("2025-06-01T10:00:00"))) == [
        at("2025-06-01T08:00:00"),
        at("2025-06-01T08:30:00"),
        at("2025-06-01T10:00:00"),
    ]


def test_a_crontab_slot_counts_days_of_the_week_from_sunday() -> None:
    grid = periodic.grid_of(crontab(minute=0, hour=3, day_of_week="sun"))
    # 2025-06-04 is a Wednesday: the last Sunday 03:00 is 2025-06-01.
    assert grid.slot_at(at("2025-06-04T12:00:00")) == at("2025-06-01T03:00:00")


def test_a_crontab_in_another_timezone_is_due_by_its_wall_clock() -> None:
    grid = periodic.Grid("crontab", cron=("0", "9", "*", "*", "*"), timezone="Asia/Jakarta")
    # 09:00 in Jakarta (UTC+7) is 02:00 UTC.
    assert grid.slot_at(at("2025-06-01T05:00:00")) == at("2025-06-01T02:00:00")
    assert periodic.Grid.parse(grid.describe()) == grid


def test_a_slot_is_written_without_colons_and_read_back() -> None:
    slot = periodic.format_slot(at("2025-06-01T10:00:00"))
    assert slot == "20250601T100000Z"
    assert periodic.slot_time(slot) == at("2025-06-01T10:00:00")


def test_the_claim_is_kept_twice_the_period_within_bounds() -> None:
    assert periodic.claim_ttl(1.0) == periodic.MIN_CLAIM_TTL
    assert periodic.claim_ttl(3600.0) == 7200.0
    assert periodic.claim_ttl(4 * 365 * 86400.0) == periodic.MAX_CLAIM_TTL


# --- the claim, in Redis ------------------------------------------------------------------


def test_the_second_claim_of_a_slot_loses_to_the_first(redis_client: Any) -> None:
    entry, slot = f"entry-{uuid.uuid4().hex[:8]}", "20250601T100000Z"
    first = periodic.claim(entry, slot, "job-a", "host-a:1", ttl=60.0)
    second = periodic.claim(entry, slot, "job-b", "host-b:2", ttl=60.0)
    assert first.won and not second.won
    assert (second.holder_task_id, second.holder_host) == ("job-a", "host-a:1")
    ttl_ms = redis_client.pttl(periodic.claim_key(entry, slot))
    assert 59_000 < ttl_ms <= 60_000
    # Only the holder gives it back (compare-and-delete): then the slot is free again.
    assert not periodic.release(second)
    assert periodic.release(first)
    assert periodic.claim(entry, slot, "job-c", "host-b:2", ttl=60.0).won


# --- W015 --------------------------------------------------------------------------------


def test_a_scheduled_task_whose_key_ignores_the_slot_is_warned() -> None:
    from django_outbox.checks.periodic import check_periodic_keys
    from tests.celery_app import app

    before = app.conf.beat_schedule
    app.conf.beat_schedule = {
        "tick": {"task": "tests.increment", "schedule": 60.0},
        "report": {"task": "tests.slot_report", "schedule": 60.0},
    }
    try:
        found = {message.obj: message for message in check_periodic_keys()}
    finally:
        app.conf.beat_schedule = before
    assert set(found) == {"tests.increment"}  # tests.slot_report keys by {slot}
    warning = found["tests.increment"]
    assert warning.id == "django_outbox.W015"
    assert "counter:{name}:op:{op_id}" in warning.msg and "{slot}" in (warning.hint or "")
