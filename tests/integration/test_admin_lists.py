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
    assert "effect happened:" in text.lower() and "Yes: applied at" in text
    assert "happen?:" not in text.lower()  # Django adds the label's colon
    assert text.index("field-effect_happened") < text.index("field-task_name")  # at the top
    other = admin_browser.get(f"/admin/django_outbox/deadletter/{missing.pk}/change/")
    assert "No: no ledger entry for its key." in other.content.decode()


def test_every_page_writes_a_time_the_same_way(admin_browser: Client) -> None:
    """Lists and row pages of attempts, dead letters, the ledger, fences and outbox
    events: ``times.shown`` (milliseconds, UTC), never Django's ``Dec. 2, 2026, 7:19
    a.m.`` in TIME_ZONE."""
    from django_outbox.models import DeadLetter, DeadLetterReason, OutboxEvent, ProcessedOperation

    at = dt.datetime(2026, 12, 2, 7, 19, 45, 160000, tzinfo=dt.UTC)
    shown = "2026-12-02 07:19:45.160 UTC"
    row = attempt(str(uuid.uuid4()), "order:8008:ship", at)
    letter = DeadLetter.objects.create(
        task_id=str(uuid.uuid4()),
        task_name="shop.ship_order",
        reason=DeadLetterReason.PERMANENT,
        first_seen=at,
        last_attempt=at,
    )
    ProcessedOperation.objects.create(
        key="order:8008:ship", task_name="t", task_id="x", fingerprint="f", processed_at=at
    )
    Fence.objects.create(task_id=str(uuid.uuid4()), token=1, taken_over_at=at)
    event = OutboxEvent.objects.create(task_name="t", created_at=at, available_at=at)
    pages = {
        "attempt list": ATTEMPTS,
        "attempt page": f"{ATTEMPTS}{row.pk}/change/",
        "dead-letter list": "/admin/django_outbox/deadletter/",
        "dead-letter page": f"/admin/django_outbox/deadletter/{letter.pk}/change/",
        "ledger list": "/admin/django_outbox/processedoperation/",
        "fence list": "/admin/django_outbox/fence/",
        "outbox list": "/admin/django_outbox/outboxevent/",
        "outbox page": f"/admin/django_outbox/outboxevent/{event.pk}/change/",
    }
    for what, url in pages.items():
        response = admin_browser.get(url)
        assert response.status_code == 200, what
        html = response.content.decode().split('id="content-main"', 1)[1]
        assert shown in html, what
        assert "a.m." not in html and "p.m." not in html, what
    # Every time field of a row's page, not only the first.
    page = admin_browser.get(f"{ATTEMPTS}{row.pk}/change/").content.decode()
    assert page.count(shown) >= 1 and "2026-12-02 07:19:45.185 UTC" in page  # finished


def test_the_dead_letter_list_opens_on_open_letters_and_the_filter_can_be_cleared(
    admin_browser: Client,
) -> None:
    from django_outbox.models import DeadLetter, DeadLetterReason, DeadLetterStatus

    now = timezone.now()

    def letter(task_id: str, status: str) -> None:
        DeadLetter.objects.create(
            task_id=task_id,
            task_name="shop.ship_order",
            reason=DeadLetterReason.PERMANENT,
            status=status,
            first_seen=now,
            last_attempt=now,
        )

    letter("letter-open", DeadLetterStatus.OPEN)
    letter("letter-replayed", DeadLetterStatus.REPLAYED)
    letter("letter-discarded", DeadLetterStatus.DISCARDED)
    page = admin_browser.get("/admin/django_outbox/deadletter/").content.decode()
    assert "letter-open" in page
    assert "letter-replayed" not in page and "letter-discarded" not in page
    assert "1 dead letter" in page
    # The filter says so, and "every status" clears it.
    assert '<li class="selected">\n    <a href="?status=open"' in page
    assert '<a href="?status=every"' in page
    every = admin_browser.get("/admin/django_outbox/deadletter/", {"status": "every"})
    text = every.content.decode()
    assert all(t in text for t in ("letter-open", "letter-replayed", "letter-discarded"))
    replayed = admin_browser.get("/admin/django_outbox/deadletter/", {"status": "replayed"})
    assert "letter-replayed" in replayed.content.decode()
    assert "letter-open" not in replayed.content.decode()


def test_attempt_list_cuts_ids_to_one_line_and_keeps_the_whole_in_the_title(
    admin_browser: Client,
) -> None:
    job = str(uuid.uuid4())
    attempt(
        job,
        "order:9009:ship",
        timezone.now(),
        outcome=Outcome.RETRY_SCHEDULED,
        error_class="shop.errors.GatewayTimeout",
        error_message="no answer in 5 s",
    )
    page = admin_browser.get(ATTEMPTS).content.decode()
    assert f'<span title="{job}" style="white-space: nowrap">{job[:8]}\u2026</span>' in page
    # The error's class beside the outcome; its module and message in the title.
    assert (
        'retry scheduled: <span title="shop.errors.GatewayTimeout: no answer in 5 s" '
        'style="white-space: nowrap">GatewayTimeout</span>' in page
    )
    # Still found by the whole task id.
    assert job in admin_browser.get(ATTEMPTS, {"q": job}).content.decode()
