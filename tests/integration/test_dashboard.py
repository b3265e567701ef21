"""The dashboard: one staff page from the admin index; empty state on an empty
database; per-bucket plots drawn as SVG on the server; live figures from Redis and the
broker; the outbox's backlog."""

from __future__ import annotations

import datetime as dt
import uuid

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
    rows = {
        row.split("</th>")[0].rsplit(">", 1)[1]: row
        for row in html.split('<tr class="series">')[1:]
    }
    assert "<td>2</td>" in rows[str(Outcome.APPLIED.label)]
    assert "<td>1</td>" in rows[str(Outcome.RETRY_SCHEDULED.label)]
    assert "<td>1</td>" in rows[str(Outcome.FENCED.label)]
    assert "<td>1</td>" in rows["permanent"]
    assert html.count('<svg class="bars"') == 4
    assert '<strong id="outbox-backlog">1</strong>' in html
    assert "could not be read" not in html  # Redis and the broker answered


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

    from celery_explicit.idempotency import SENT_AT_HEADER
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
        assert f"{queue}: 2 waiting, oldest 5min" in html
        # A message no ExplicitTask sent has no such header: its age is said unknown.
        del oldest["headers"][SENT_AT_HEADER]
        redis_client.lset(queue, -1, json.dumps(oldest))
        html = staff.get(URL).content.decode()
        assert f"{queue}: 2 waiting, oldest unknown (not sent by an ExplicitTask)" in html
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
        return pages[-1] if f"{queue}: 2 waiting, oldest 5min" in pages[-1] else None

    html = wait_for(
        aged,
        timeout=20,
        interval=1.0,
        what="the management API's head message timestamp",
        on_timeout=lambda: pages[-1].split("Queues:")[-1][:400],
    )
    assert "could not be read" not in html

    # Turned off: said so, and the depth is still read.
    settings.EXPLICIT_RABBITMQ_MANAGEMENT_URL = "off"
    html = staff.get(URL).content.decode()
    assert f"{queue}: 2 waiting, oldest not read" in html
