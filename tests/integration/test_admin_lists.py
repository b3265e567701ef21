"""The admin lists an on-call engineer reads: times to the millisecond, durations to the
millisecond, task id, host and pid, a mark for a second execution of one delivery and for
redeliveries, substring search over keys and task ids, and fence rows read-only."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from django_outbox.models import Attempt, Fence, Outcome

pytestmark = pytest.mark.django_db

ATTEMPTS = "/admin/django_outbox/attempt/"


@pytest.fixture
def admin_browser() -> Client:
    user = User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}", password="pw")
    client = Client()
    client.force_login(user)
    return client


def attempt(task_id: str, key: str, started: dt.datetime, **kw: object) -> Attempt:
    fields: dict[str, object] = dict(
        task_id=task_id,
        task_name="shop.ship_order",
        idempotency_key=key,
        attempt=1,
        worker_host="worker-2",
        worker_pid=811,
        started_at=started,
        finished_at=started + dt.timedelta(milliseconds=25.141000000000002),
        duration_ms=25.141000000000002,
        outcome=Outcome.APPLIED,
    )
    fields.update(kw)
    return Attempt.objects.create(**fields)


def test_attempts_show_milliseconds_task_id_worker_and_marks(admin_browser: Client) -> None:
    start = timezone.now().replace(microsecond=412000)
    job = str(uuid.uuid4())
    attempt(job, "order:1003:ship", start, outcome=Outcome.FENCED)
    attempt(job, "order:1003:ship", start + dt.timedelta(milliseconds=300), redelivered=True)
    page = admin_browser.get(ATTEMPTS).content.decode()
    assert job in page
    assert timezone.localtime(start).strftime("%H:%M:%S.412") in page
    assert "25 ms" in page and "25.141000000000002" not in page
    assert "worker-2 pid 811" in page
    assert "redelivered, second execution" in page  # the later row of the same attempt


def test_a_business_id_finds_every_key_it_is_part_of(admin_browser: Client) -> None:
    start = timezone.now()
    attempt(str(uuid.uuid4()), "order:ORD-1003:ship", start)
    attempt(str(uuid.uuid4()), "payment:ORD-1003:capture", start)
    attempt(str(uuid.uuid4()), "order:ORD-2000:ship", start)
    page = admin_browser.get(ATTEMPTS, {"q": "ORD-1003"}).content.decode()
    assert "order:ORD-1003:ship" in page and "payment:ORD-1003:capture" in page
    assert "order:ORD-2000:ship" not in page
    ledger = admin_browser.get("/admin/django_outbox/processedoperation/", {"q": "1003"})
    assert ledger.status_code == 200


def test_a_whole_task_or_correlation_id_finds_its_attempts(admin_browser: Client) -> None:
    job, other = str(uuid.uuid4()), str(uuid.uuid4())
    attempt(job, "order:1:ship", timezone.now(), correlation_id="req-77")
    attempt(other, "order:2:ship", timezone.now())
    page = admin_browser.get(ATTEMPTS, {"q": job}).content.decode()
    assert "order:1:ship" in page and "order:2:ship" not in page
    page = admin_browser.get(ATTEMPTS, {"q": "req-77"}).content.decode()
    assert "order:1:ship" in page and "order:2:ship" not in page


@pytest.mark.parametrize(
    ("model", "term"),
    [
        ("attempt", "ORD-1003"),
        ("processedoperation", "ORD-1003"),
        ("deadletter", "ORD-1003"),
    ],
)
def test_the_admin_search_is_served_by_an_index(model: str, term: str) -> None:
    """The plan of the query the search box builds uses the indexes of migration 0011,
    not a scan of the whole table (sequential scans off, as on a large table)."""
    from django.apps import apps
    from django.contrib.admin.sites import site
    from django.db import connection
    from django.test import RequestFactory

    model_class = apps.get_model("django_outbox", model)
    model_admin = site._registry[model_class]
    found, _ = model_admin.get_search_results(
        RequestFactory().get("/"), model_class.objects.all(), term
    )
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        sql, params = found.query.sql_with_params()
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Seq Scan" not in plan, plan
    assert "_trgm" in plan, plan


def test_fence_rows_are_listed_and_read_only(admin_browser: Client) -> None:
    job = str(uuid.uuid4())
    Fence.objects.create(
        task_id=job,
        token=7,
        idempotency_key="order:7:ship",
        taken_over_from="vm:4242",
        taken_over_at=timezone.now(),
    )
    listing = admin_browser.get("/admin/django_outbox/fence/")
    assert listing.status_code == 200 and job in listing.content.decode()
    assert "vm:4242" in listing.content.decode()
    assert admin_browser.get("/admin/django_outbox/fence/add/").status_code == 403
    change = admin_browser.post(f"/admin/django_outbox/fence/{job}/change/", {"token": 1})
    assert change.status_code in (302, 403)
    assert Fence.objects.get(task_id=job).token == 7  # evidence is not edited


def test_the_job_page_shows_the_verdict_and_links_every_row(admin_browser: Client) -> None:
    from django_outbox.models import ProcessedOperation

    start = timezone.now()
    job = str(uuid.uuid4())
    first = attempt(
        job,
        "order:5005:ship",
        start,
        outcome=Outcome.RETRY_SCHEDULED,
        error_class="shop.GatewayTimeout",
        retry_delay=1.5,
    )
    attempt(job, "order:5005:ship", start + dt.timedelta(seconds=2), attempt=2)
    ProcessedOperation.objects.create(
        key="order:5005:ship",
        task_name="shop.ship_order",
        task_id=job,
        fingerprint="f",
        processed_at=start,
    )
    page = admin_browser.get("/admin/django_outbox/attempt/job/", {"q": "5005"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "Verdict:" in html and "effect applied once" in html
    assert "1 retry after GatewayTimeout" in html
    assert f"/admin/django_outbox/attempt/{first.pk}/change/" in html
    assert "/admin/django_outbox/processedoperation/" in html
    # Reachable from the attempt list.
    assert (
        "/admin/django_outbox/attempt/job/?q=order%3A5005%3Aship"
        in admin_browser.get(ATTEMPTS).content.decode()
    )
    unknown = admin_browser.get("/admin/django_outbox/attempt/job/", {"q": "no-such-job"})
    assert unknown.status_code == 200 and "nothing recorded for" in unknown.content.decode()


def test_the_job_page_needs_the_view_permission() -> None:
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:6]}", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get("/admin/django_outbox/attempt/job/", {"q": "x"}).status_code == 403


def test_a_dead_letter_says_first_whether_its_effect_happened(admin_browser: Client) -> None:
    from django_outbox.models import DeadLetter, DeadLetterReason, ProcessedOperation

    now = timezone.now()

    def letter(key: str) -> DeadLetter:
        return DeadLetter.objects.create(
            task_id=str(uuid.uuid4()),
            task_name="shop.ship_order",
            idempotency_key=key,
            reason=DeadLetterReason.CONFLICT,
            first_seen=now,
            last_attempt=now,
        )

    applied, missing = letter("order:6006:ship"), letter("order:7007:ship")
    ProcessedOperation.objects.create(
        key="order:6006:ship",
        task_name="shop.ship_order",
        task_id="t-6006",
        fingerprint="f",
        processed_at=now,
    )
    html = admin_browser.get(f"/admin/django_outbox/deadletter/{applied.pk}/change/")
    text = html.content.decode()
    assert "did the effect happen?" in text.lower() and "Yes: applied at" in text
    assert text.index("field-effect_happened") < text.index("field-task_name")  # at the top
    other = admin_browser.get(f"/admin/django_outbox/deadletter/{missing.pk}/change/")
    assert "No: no ledger row for its key." in other.content.decode()
