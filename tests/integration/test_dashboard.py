"""The dashboard: one staff page from the admin index; empty state on an empty
database; per-bucket plots drawn as SVG on the server; live figures from Redis and the
broker; the outbox's backlog."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, OutboxEvent, Outcome

pytestmark = pytest.mark.django_db

URL = "/admin/django_outbox/dashboard/"


@pytest.fixture
def staff() -> Client:
    user = User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}", password="pw")
    client = Client()
    client.force_login(user)
    return client


def test_linked_from_the_admin_index_and_empty_without_data(staff: Client) -> None:
    assert URL in staff.get("/admin/").content.decode()
    page = staff.get(URL)
    assert page.status_code == 200
    html = page.content.decode()
    assert "No attempts in the last 1 h." in html
    assert "No dead letters in the last 1 h." in html
    assert '<strong id="outbox-backlog">0</strong>' in html
    assert "<script" not in html.split('id="content-main"')[1]  # plots need no script


def test_plots_count_attempts_dead_letters_and_the_backlog(staff: Client) -> None:
    now = timezone.now()
    for i, outcome in enumerate(
        [Outcome.APPLIED, Outcome.APPLIED, Outcome.RETRY_SCHEDULED, Outcome.FENCED]
    ):
        Attempt.objects.create(
            task_id=str(uuid.uuid4()),
            task_name="t",
            idempotency_key=f"k{i}",
            attempt=1,
            started_at=now - dt.timedelta(minutes=i),
            finished_at=now,
            duration_ms=1.0,
            outcome=outcome,
        )
    DeadLetter.objects.create(
        task_id="d1",
        task_name="t",
        reason=DeadLetterReason.PERMANENT,
        first_seen=now,
        last_attempt=now,
    )
    OutboxEvent.objects.create(task_name="t")
    html = staff.get(URL, {"hours": "6"}).content.decode()
    assert "<strong>6 h</strong>" in html
    rows = series_rows(html)
    assert '<td class="count">2</td>' in rows[str(Outcome.APPLIED.label)]
    assert '<td class="count">1</td>' in rows[str(Outcome.RETRY_SCHEDULED.label)]
    assert '<td class="count">1</td>' in rows[str(Outcome.FENCED.label)]
    # A dead letter's reason in the list's words, not its code.
    assert '<td class="count">1</td>' in rows[str(DeadLetterReason.PERMANENT.label)]
    assert "permanent" not in rows
    assert html.count('<svg class="bars"') == 4
    assert '<strong id="outbox-backlog">1</strong>' in html
    assert "could not be read" not in html  # Redis and the broker answered


def series_rows(html: str) -> dict[str, str]:
    """Each plot's row of the dashboard, by its label."""
    return {
        row.split("</th>")[0].rsplit(">", 1)[1]: row.split("</tr>")[0]
        for row in html.split('<tr class="series ')[1:]
    }


def test_a_staff_member_without_the_attempts_permission_is_refused() -> None:
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:6]}", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get(URL).status_code == 403


def test_each_queue_shows_its_depth_and_the_age_of_its_oldest_message(
    staff: Client, queue: str, redis_client, monkeypatch
) -> None:
    import json
    import time

    from celery_explicit.headers import SENT_AT_HEADER
    from tests.celery_app import app
    from tests.testapp.tasks import Increment

    monkeypatch.setitem(app.conf, "task_default_queue", queue)
    try:
        for op in ("1", "2"):
            app.tasks[Increment.name].apply_async(kwargs={"name": "q", "op_id": op}, queue=queue)
        # The oldest is the list's right end (kombu pushes left, pops right): age it by
        # five minutes, as if it had waited that long.
        oldest = json.loads(redis_client.lindex(queue, -1))
        assert oldest["headers"][SENT_AT_HEADER] <= time.time()
        oldest["headers"][SENT_AT_HEADER] = time.time() - 300
        redis_client.lset(queue, -1, json.dumps(oldest))
        html = staff.get(URL).content.decode()
        assert f"{queue}: 2 in all (2 waiting, 0 held by workers), oldest 5min" in html
        # A message no ExplicitTask sent has no such header: its age is said unknown.
        del oldest["headers"][SENT_AT_HEADER]
        redis_client.lset(queue, -1, json.dumps(oldest))
        html = staff.get(URL).content.decode()
        assert (
            f"{queue}: 2 in all (2 waiting, 0 held by workers), "
            "oldest unknown (not sent by an ExplicitTask)" in html
        )
    finally:
        redis_client.delete(queue)


def test_a_rabbitmq_queue_shows_the_age_of_its_head_message(
    staff: Client, rabbitmq_queue_with_old_head: str, settings
) -> None:
    """AMQP cannot peek: the age comes from RabbitMQ's management API, which reports the
    head message's AMQP timestamp (set on every ExplicitTask publish)."""
    from tests.support.waiting import wait_for

    queue = rabbitmq_queue_with_old_head
    # The management API refreshes its queue figures every few seconds.
    pages: list[str] = []

    def aged() -> str | None:
        pages.append(staff.get(URL).content.decode())
        shown = f"{queue}: 2 in all (2 waiting, 0 held by workers), oldest 5min"
        return pages[-1] if shown in pages[-1] else None

    html = wait_for(
        aged,
        timeout=20,
        interval=1.0,
        what="the management API's head message timestamp",
        on_timeout=lambda: pages[-1].split('<ul class="queues">')[-1][:400],
    )
    assert "could not be read" not in html

    # Turned off: said so, and the depth is still read.
    settings.EXPLICIT_RABBITMQ_MANAGEMENT_URL = "off"
    html = staff.get(URL).content.decode()
    assert f"{queue}: 2 waiting, held by workers unknown (not read" in html
    assert "oldest not read" in html


def bars_by_minute(svg_row: str) -> dict[str, tuple[str, str, str]]:
    """{data-minute: (x of its bar, its link or "", its tooltip)} of one plot's row."""
    found = {}
    for bucket in svg_row.split('class="bucket"')[1:]:
        minute = bucket.split('data-minute="', 1)[1].split('"', 1)[0]
        href = bucket.split('href="', 1)[1].split('"', 1)[0] if 'href="' in bucket[:20] else ""
        x = bucket.split('<rect class="bar" x="', 1)[1].split('"', 1)[0]
        tip = bucket.split("<title>", 1)[1].split("</title>", 1)[0]
        found[minute] = (x, href, tip)
    return found


def test_one_time_axis_the_same_minute_at_the_same_x_and_bars_link_to_their_rows(
    staff: Client,
) -> None:
    import html as html_module

    from django_outbox.models import DeadLetterStatus

    minute = (timezone.now() - dt.timedelta(minutes=7)).replace(second=30, microsecond=0)
    for outcome, count in ((Outcome.APPLIED, 3), (Outcome.RETRY_SCHEDULED, 1)):
        for i in range(count):
            Attempt.objects.create(
                task_id=f"axis-{outcome}-{i}",
                task_name="t",
                attempt=1,
                started_at=minute + dt.timedelta(seconds=i),
                finished_at=minute,
                duration_ms=1.0,
                outcome=outcome,
            )
    # Outside the bar's minute: its link must not list it.
    Attempt.objects.create(
        task_id="axis-other-minute",
        task_name="t",
        attempt=1,
        started_at=minute + dt.timedelta(minutes=2),
        finished_at=minute,
        duration_ms=1.0,
        outcome=Outcome.APPLIED,
    )
    DeadLetter.objects.create(
        task_id="axis-letter",
        task_name="t",
        reason=DeadLetterReason.BAD_INPUT,
        status=DeadLetterStatus.DISCARDED,  # counted in the inflow whatever became of it
        first_seen=minute,
        last_attempt=minute,
    )
    html = staff.get(URL).content.decode()
    rows = series_rows(html)
    at = minute.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M")
    applied = bars_by_minute(rows[str(Outcome.APPLIED.label)])
    retried = bars_by_minute(rows[str(Outcome.RETRY_SCHEDULED.label)])
    letters = bars_by_minute(rows[str(DeadLetterReason.BAD_INPUT.label)])
    # The same minute is drawn at the same x in every plot, and every plot of the
    # window has every minute.
    assert applied[at][0] == retried[at][0] == letters[at][0]
    assert list(applied) == list(retried) == list(letters)
    # The tooltip: the minute and the count, in the list's words.
    end = (minute + dt.timedelta(minutes=1)).astimezone(dt.UTC).strftime("%H:%M")
    assert applied[at][2] == f"{at}\u2013{end} UTC: 3 {Outcome.APPLIED.label}"
    assert letters[at][2] == f"{at}\u2013{end} UTC: 1 {DeadLetterReason.BAD_INPUT.label}"
    # The time axis: labelled ticks in UTC, at the x of their minute in the plots.
    axis = html.split('<svg class="axis"', 1)[1].split("</svg>", 1)[0]
    ticks = [t.split("</text>")[0].rsplit(">", 1)[1] for t in axis.split("<text")[1:]]
    assert len(ticks) >= 6 and ticks[-1] == "UTC", ticks
    for tick in ticks[:-1]:
        tick_minute = next(m for m in applied if m.endswith(tick))
        assert f'x1="{applied[tick_minute][0]}"' in axis
    # A bar links to the rows it counts: that minute, that outcome.
    listed = staff.get(html_module.unescape(applied[at][1])).content.decode()
    assert all(f'title="axis-applied-{i}"' in listed for i in range(3))
    assert "3 attempts" in listed and "axis-other-minute" not in listed
    letter_list = staff.get(html_module.unescape(letters[at][1])).content.decode()
    assert "1 dead letter" in letter_list and "axis-letter" in letter_list
    # Minutes with nothing have a tooltip and no link.
    empty = next(m for m, (_, href, _tip) in applied.items() if not href)
    assert applied[empty][2].endswith(f": 0 {Outcome.APPLIED.label}")


def test_open_dead_letters_by_reason_with_the_oldest(staff: Client) -> None:
    from django_outbox import times
    from django_outbox.models import DeadLetterStatus

    now = timezone.now()

    def letter(reason: str, days: float, status: str = DeadLetterStatus.OPEN) -> None:
        at = now - dt.timedelta(days=days)
        DeadLetter.objects.create(
            task_id=str(uuid.uuid4()),
            task_name="t",
            reason=reason,
            status=status,
            first_seen=at,
            last_attempt=at,
        )

    # Older than any window: still open, still on the page.
    letter(DeadLetterReason.EXHAUSTED, 3)
    letter(DeadLetterReason.EXHAUSTED, 0.5)
    letter(DeadLetterReason.BAD_INPUT, 0.01)
    letter(DeadLetterReason.BAD_INPUT, 9, status=DeadLetterStatus.REPLAYED)  # not open
    html = staff.get(URL).content.decode()
    assert '<span id="open-letters-total">3</span>' in html
    rows = {
        r.split("</a>")[0].rsplit(">", 1)[1]: r.split("</tr>")[0]
        for r in html.split('<tr class="open-reason">')[1:]
    }
    exhausted = rows[str(DeadLetterReason.EXHAUSTED.label)]
    assert '<td class="count">2</td>' in exhausted
    assert times.shown(now - dt.timedelta(days=3)) in exhausted and "3.0d ago" in exhausted
    bad_input = rows[str(DeadLetterReason.BAD_INPUT.label)]
    assert '<td class="count">1</td>' in bad_input
    assert times.shown(now - dt.timedelta(days=0.01)) in bad_input
    # The oldest first; each links to its open letters.
    assert list(rows) == [
        str(DeadLetterReason.EXHAUSTED.label),
        str(DeadLetterReason.BAD_INPUT.label),
    ]
    assert "reason__exact=exhausted" in exhausted


@pytest.mark.django_db(transaction=True)
def test_a_queue_counts_the_messages_a_worker_holds_unacknowledged(
    start_worker: Any, queue: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real worker, one process, prefetching four: one job runs, the next waits in
    the worker for the process. The queue itself is empty; both are the queue's."""
    from tests.celery_app import app
    from tests.support.waiting import wait_for
    from tests.testapp.tasks import HoldsTheLine

    user = User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}", password="pw")
    client = Client()
    client.force_login(user)
    monkeypatch.setitem(app.conf, "task_default_queue", queue)
    start_worker(concurrency=1, prefetch_multiplier=4)
    task = app.tasks[HoldsTheLine.name]
    first, second = f"held-{uuid.uuid4().hex[:6]}", f"held-{uuid.uuid4().hex[:6]}"
    task.apply_async(kwargs={"name": "held", "op_id": first, "seconds": 6.0}, queue=queue)
    wait_for(lambda: redis_client.llen(f"started:{first}"), what="the first job running")
    task.apply_async(kwargs={"name": "held", "op_id": second, "seconds": 0.0}, queue=queue)
    pages: list[str] = []

    def held() -> bool:
        pages.append(client.get(URL).content.decode())
        return f"{queue}: 2 in all (0 waiting, 2 held by workers)" in pages[-1]

    try:
        wait_for(
            held,
            timeout=20,
            interval=0.2,
            what="both jobs counted as held by the worker",
            on_timeout=lambda: pages[-1].split('<ul class="queues">')[-1][:300],
        )
        assert redis_client.llen(f"started:{second}") == 0  # still waiting in the worker
    finally:
        redis_client.delete(f"started:{first}", f"started:{second}", f"spans:{first}")


def test_a_rate_limited_key_is_listed_while_it_has_starts_booked_ahead(
    staff: Client, redis_client: Any
) -> None:
    from celery_explicit import RateLimit, rate_limit

    key = f"test-dash:{uuid.uuid4().hex[:8]}"
    limit = RateLimit("test-dash:{k}", 1, per=90.0)
    try:
        rate_limit.admit(limit, key)
        _wait, start, _why = rate_limit.admit(limit, key)  # the second is booked 90 s ahead
        rate_limit.note_limited(key, start)
        html = staff.get(URL).content.decode()
        assert f"<strong>{key}</strong> (booked 9" in html
    finally:
        redis_client.delete(*rate_limit.state_keys(key))
        redis_client.zrem(rate_limit.limited_set(), key)
    assert key not in staff.get(URL).content.decode()


def test_a_periodic_slot_no_beat_published_is_listed(staff: Client) -> None:
    import datetime as dt

    from celery_explicit import periodic
    from django_outbox.store import periodic_slots

    entry = f"report-{uuid.uuid4().hex[:6]}"
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    assert "None: every slot of every entry was published." in staff.get(URL).content.decode()
    for minutes_ago in (10, 9, 6):  # 8 and 7 minutes ago: every beat was down
        periodic_slots.record(
            entry=entry,
            slot=now - dt.timedelta(minutes=minutes_ago),
            task_name="tests.slot_report",
            task_id=str(uuid.uuid4()),
            idempotency_key=f"slotreport:{minutes_ago}",
            published_by="beat-host:42",
            grid="every 60s",
        )
    html = staff.get(URL).content.decode()
    first = periodic.format_slot(now - dt.timedelta(minutes=8))
    assert f"<strong>{entry}</strong> (tests.slot_report): " in html
    assert f"the first {first}" in html
