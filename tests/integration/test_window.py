"""The window report: every unusual thing of a time window, grouped by cause, and
nothing from outside it or from jobs that simply worked."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from django_outbox.incident import window
from django_outbox.models import Attempt, DeadLetter, Fence

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 2, 2, 50, tzinfo=UTC)


def attempt(key: str, at: datetime, outcome: str = "applied", **fields: object) -> Attempt:
    return Attempt.objects.create(
        task_id=fields.pop("task_id", uuid.uuid4().hex),
        task_name="shop.ship_order",
        idempotency_key=key,
        attempt=fields.pop("attempt", 1),
        worker_host="celery@a",
        worker_pid=10,
        started_at=at,
        finished_at=at + timedelta(milliseconds=20),
        duration_ms=20.0,
        outcome=outcome,
        **fields,
    )


def test_a_window_groups_what_was_unusual_by_cause() -> None:
    inside = T0 + timedelta(minutes=5)
    for n in range(30):  # jobs that simply worked: in no group
        attempt(f"order:OK-{n}:ship", inside)
    retried = attempt("order:ORD-1:ship", inside, "retry_scheduled")
    attempt("order:ORD-1:ship", inside + timedelta(seconds=2), "applied", task_id=retried.task_id)
    attempt("order:ORD-2:ship", inside, "applied", redelivered=True)
    attempt("order:ORD-3:ship", inside, "fenced")
    attempt("order:ORD-4:ship", inside, "applied", deferrals={"ordering": 3})
    attempt("order:ORD-5:ship", inside, "applied", deferrals={})
    killed = attempt("order:ORD-6:ship", inside, "applied", redelivered=True)
    Fence.objects.create(
        task_id=killed.task_id,
        token=7,
        idempotency_key="order:ORD-6:ship",
        taken_over_from="a:9",
        taken_over_at=inside,
        cause="holder_dead",
    )
    DeadLetter.objects.create(
        task_id="t-conflict",
        task_name="shop.ship_order",
        idempotency_key="order:ORD-7:ship",
        reason="conflict",
        first_seen=inside,
        last_attempt=inside,
    )
    # Outside the window: the same kinds, none reported.
    attempt("order:LATE-1:ship", T0 + timedelta(minutes=31), "fenced")
    attempt("order:EARLY-1:ship", T0 - timedelta(seconds=1), "retry_scheduled")

    report = window.report(T0, T0 + timedelta(minutes=30))
    by_cause = {g.cause: g for g in report.groups}
    assert set(by_cause) == {
        "outcome:retry_scheduled",
        "redelivered",
        "outcome:fenced",
        "deferred:ordering",
        "takeover:holder_dead",
        "dead_letter:conflict",
    }
    assert [j.key for j in by_cause["redelivered"].named(20)] == [
        "order:ORD-2:ship",
        "order:ORD-6:ship",
    ]
    assert by_cause["takeover:holder_dead"].label == "taken over after its holder died"
    assert by_cause["takeover:holder_dead"].named(20)[0].task_name == "shop.ship_order"
    assert by_cause["dead_letter:conflict"].label == "dead-lettered: idempotency conflict"
    assert by_cause["outcome:retry_scheduled"].label == "retry scheduled"
    assert report.jobs == 6  # ORD-1..7 but ORD-5, whose empty deferrals are none

    text = report.as_text()
    assert "6 job(s) with something unusual" in text
    assert "LATE-1" not in text and "EARLY-1" not in text and "OK-" not in text
    assert "2026-12-02 02:55:00.000 UTC  order:ORD-3:ship" in text
    data = json.loads(json.dumps(report.as_json()))
    assert data["since"] == "2026-12-02T02:50:00.000+00:00"
    assert {g["cause"]: g["jobs"] for g in data["groups"]}["redelivered"] == 2


def test_a_quiet_window_says_so_and_the_limit_keeps_the_counts() -> None:
    quiet = window.report(T0, T0 + timedelta(minutes=1))
    assert quiet.groups == [] and "nothing unusual" in quiet.as_text()

    for n in range(25):
        attempt(f"order:R-{n:02d}:ship", T0 + timedelta(seconds=n), "retry_scheduled")
    busy = window.report(T0, T0 + timedelta(minutes=1))
    text = busy.as_text(limit=3)
    assert "retry scheduled: 25 time(s), 25 job(s)" in text
    assert "order:R-02:ship" in text and "order:R-03:ship" not in text
    assert "... and 22 more" in text


def test_a_window_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"ends .* before it starts"):
        window.report(T0, T0 - timedelta(minutes=1))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("02:50", datetime(2026, 12, 2, 2, 50, tzinfo=UTC)),
        ("03:20:30", datetime(2026, 12, 2, 3, 20, 30, tzinfo=UTC)),
        ("23:00", datetime(2026, 12, 1, 23, 0, tzinfo=UTC)),  # not in the future
        ("2026-11-30T10:00", datetime(2026, 11, 30, 10, 0, tzinfo=UTC)),
        ("2026-11-30T12:00+02:00", datetime(2026, 11, 30, 10, 0, tzinfo=UTC)),
    ],
)
def test_times_of_a_window(text: str, expected: datetime) -> None:
    now = datetime(2026, 12, 2, 3, 30, tzinfo=UTC)
    assert window.parse_time(text, now=now) == expected


def test_a_time_that_is_no_time_is_refused_with_the_forms_it_takes() -> None:
    with pytest.raises(ValueError, match="'yesterday' is not a time: give an ISO 8601"):
        window.parse_time("yesterday")


def test_manage_py_explain_takes_a_window() -> None:
    import io

    from django.core.management import call_command

    attempt("order:ORD-9:ship", T0 + timedelta(minutes=1), "exhausted")
    out = io.StringIO()
    call_command(
        "explicit_explain", "--since", "2026-12-02T02:50", "--until", "2026-12-02T03:20", stdout=out
    )
    assert "failed: attempts exhausted: 1 time(s), 1 job(s)" in out.getvalue()
    assert "order:ORD-9:ship" in out.getvalue()
    out = io.StringIO()
    call_command("explicit_explain", "--since", "2026-12-02T02:50+00:00", "--json", stdout=out)
    assert json.loads(out.getvalue())["groups"][0]["named"][0]["key"] == "order:ORD-9:ship"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--since", "soon"], "'soon' is not a time"),
        (["--until", "2026-12-02T03:20"], "a window needs --since"),
        (["ORD-9", "--since", "02:50"], r"or a window \(--since/--until\), not both"),
        (["--since", "2026-12-02T03:20", "--until", "2026-12-02T02:50"], "before it starts"),
        (["--since", "02:50", "--limit", "0"], "--limit 0: at least 1"),
        ([], "say what to explain"),
    ],
)
def test_a_window_asked_wrongly_is_one_clear_error(argv: list[str], error: str) -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=error):
        call_command("explicit_explain", *argv)
