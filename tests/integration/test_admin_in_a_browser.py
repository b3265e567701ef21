"""The on-call pages in a real headless browser: Debian's chromium driven by Playwright.

Logs in, opens the dashboard, a job page and the dead letter list, and replays a letter
through the admin action. Fails on any server error, a missing element or a plot that
did not render. Screenshots go to the test's pytest tmp dir (the test prints the
folder)."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from django_outbox.models import (
    Attempt,
    DeadLetter,
    DeadLetterReason,
    DeadLetterStatus,
    Outcome,
    ProcessedOperation,
)

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = "/usr/bin/chromium"
# What the workplace's probe starts Chromium with: no sandbox as root, and nothing that
# reaches for the network on its own.
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def history(redis_client: Any, queue: str) -> dict[str, Any]:
    """A job that retried then applied, and an open dead letter, made before the browser
    starts (Playwright's loop would make the ORM refuse to run in this thread)."""
    password = uuid.uuid4().hex
    user = User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}", password=password)
    # Mid-minute, so the retry one second later falls in the same minute.
    start = (timezone.now() - dt.timedelta(minutes=3)).replace(second=20, microsecond=0)
    job = str(uuid.uuid4())
    key = f"order:{uuid.uuid4().int % 10**6}:ship"
    for number, outcome in ((1, Outcome.RETRY_SCHEDULED), (2, Outcome.APPLIED)):
        Attempt.objects.create(
            task_id=job,
            task_name="tests.increment",
            idempotency_key=key,
            attempt=number,
            worker_host="worker-1",
            worker_pid=800 + number,
            started_at=start + dt.timedelta(seconds=number),
            finished_at=start + dt.timedelta(seconds=number, milliseconds=25),
            duration_ms=25.0,
            outcome=outcome,
            error_class="shop.GatewayTimeout" if number == 1 else "",
            retry_delay=1.0 if number == 1 else None,
        )
    ProcessedOperation.objects.create(
        key=key, task_name="tests.increment", task_id=job, fingerprint="f", processed_at=start
    )
    letter = DeadLetter.objects.create(
        task_id=str(uuid.uuid4()),
        task_name="tests.increment",
        kwargs={"name": "browser", "op_id": "1"},
        idempotency_key="counter:browser:op:1",
        reason=DeadLetterReason.PERMANENT,
        error_class="builtins.ValueError",
        error_message="boom",
        first_seen=start,
        last_attempt=start,
        queue=queue,
    )
    minute = start.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M")
    since = start - dt.timedelta(minutes=5)
    yield {
        "window_since": since.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M"),
        "today": timezone.now().astimezone(dt.UTC).strftime("%Y-%m-%d"),
        "user": user.username,
        "password": password,
        "key": key,
        "job": job,
        "letter": letter,
        "minute": minute,
    }
    redis_client.delete(queue)


def test_dashboard_job_page_and_replay_in_chromium(
    live_server: Any, history: dict[str, Any], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    shots = tmp_path / "screenshots"
    shots.mkdir()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"screenshots: {shots}")
    server_errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on(
            "response",
            lambda r: server_errors.append(f"{r.status} {r.url}") if r.status >= 500 else None,
        )
        page.goto(f"{live_server.url}/admin/login/")
        page.fill("#id_username", history["user"])
        page.fill("#id_password", history["password"])
        page.click("input[type=submit]")
        page.wait_for_selector("#content-main")

        page.click("text=Dashboard")
        page.wait_for_selector("#outbox-backlog")
        assert page.locator("svg.bars").count() >= 2  # attempts by outcome: plots drawn
        assert page.locator("svg.bars rect").count() > 0
        page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
        # A time axis with labelled ticks (HH:MM, UTC) under the plots.
        labels = page.locator("svg.axis").first.locator("text").all_text_contents()
        assert len(labels) >= 6 and labels[-1] == "UTC", labels
        assert all(len(t) == 5 and t[2] == ":" for t in labels[:-1]), labels
        # The same minute at the same x on the screen in the attempt and dead-letter
        # plots; the tooltip names the minute and the count.
        minute = history["minute"]
        applied = page.locator(f"tr.attempts a.bucket[data-minute='{minute}']").first
        letter = page.locator(f"tr.dead-letters a.bucket[data-minute='{minute}']").first
        applied_box, letter_box = applied.bounding_box(), letter.bounding_box()
        assert applied_box is not None and letter_box is not None
        assert abs(applied_box["x"] - letter_box["x"]) < 0.5, (applied_box, letter_box)
        tip = applied.locator("title").text_content() or ""
        assert tip.startswith(minute) and tip.endswith(": 1 effect applied"), tip
        applied.hover()
        page.screenshot(path=str(shots / "dashboard-hover.png"), full_page=True)
        # The bar opens the attempts of that minute and outcome.
        applied.click()
        page.wait_for_selector("#result_list")
        assert page.locator("#result_list tbody tr").count() == 1
        assert "effect applied" in page.locator("#result_list tbody tr").inner_text()
        page.screenshot(path=str(shots / "attempts-of-a-minute.png"), full_page=True)

        page.goto(f"{live_server.url}/admin/django_outbox/attempt/job/?q={history['key']}")
        verdict = page.locator("p.verdict").inner_text()
        assert "effect applied once" in verdict and "1 retry after GatewayTimeout" in verdict
        assert page.locator("table.timeline tbody tr").count() >= 3
        page.screenshot(path=str(shots / "job.png"), full_page=True)

        # At 1400 px the attempt list fits: no horizontal scroll of the page or of the
        # list, the explain column in view, task ids on one line.
        page.goto(f"{live_server.url}/admin/django_outbox/attempt/")
        page.screenshot(path=str(shots / "attempts.png"), full_page=True)
        worker = page.locator("td.field-worker").first
        assert "worker-1 pid 80" in worker.inner_text()
        widths = page.evaluate(
            "() => [document.scrollingElement.scrollWidth, document.scrollingElement.clientWidth,"
            " document.querySelector('.results').scrollWidth,"
            " document.querySelector('.results').clientWidth]"
        )
        assert widths[0] <= widths[1] and widths[2] <= widths[3], widths
        explain = page.locator("td.field-job").first.bounding_box()
        assert explain is not None and explain["x"] + explain["width"] <= 1400, explain
        task = page.locator("td.field-task span").first
        assert task.get_attribute("title") == history["job"]
        line = page.evaluate("() => parseFloat(getComputedStyle(document.body).lineHeight) || 20")
        task_box = task.bounding_box()
        assert task_box is not None and task_box["height"] <= 1.5 * line, task_box

        # The dead letter page answers "did the effect happen?" and offers replay.
        letter_pk = history["letter"].pk
        page.goto(f"{live_server.url}/admin/django_outbox/deadletter/{letter_pk}/change/")
        assert "No: no ledger entry" in page.locator("div.field-effect_happened").inner_text()
        page.screenshot(path=str(shots / "dead-letter.png"), full_page=True)

        page.goto(f"{live_server.url}/admin/django_outbox/deadletter/")
        page.check(f"input[name=_selected_action][value='{letter_pk}']")
        page.select_option("select[name=action]", "replay")
        page.click("button[name=index]")
        # The confirmation page first: nothing replayed until its button is pressed.
        page.wait_for_selector("#confirm-rows")
        assert "Published again to" in page.locator("#confirm-rows").inner_text()
        page.screenshot(path=str(shots / "replay-confirm.png"), full_page=True)
        assert "Yes, replay 1 dead letter(s)" in page.locator("#confirm").input_value()
        page.click("#confirm")
        page.wait_for_selector("ul.messagelist")
        assert "Replayed 1 dead letter(s)." in page.locator("ul.messagelist").inner_text()
        page.screenshot(path=str(shots / "dead-letters.png"), full_page=True)

        # The replayed letter stays in its job's verdict, with who closed it and when.
        page.goto(f"{live_server.url}/admin/django_outbox/attempt/job/?q=counter:browser:op:1")
        closed = page.locator("p.verdict").inner_text()
        assert f"replayed at {history['today']}" in closed and history["user"] in closed, closed
        page.screenshot(path=str(shots / "job-after-replay.png"), full_page=True)

        # The window page: what was unusual in the last ten minutes, linked to each job.
        page.goto(f"{live_server.url}/admin/django_outbox/attempt/window/")
        page.fill("#window-since", history["window_since"])
        page.click("#window-form input[type=submit]")
        page.wait_for_selector("p.window-summary")
        headings = page.locator("div.window-group h2").all_text_contents()
        assert "retry scheduled: 1 time(s), 1 job(s)" in headings, headings
        assert "dead-lettered: permanent error: 1 time(s), 1 job(s)" in headings, headings
        page.screenshot(path=str(shots / "window.png"), full_page=True)
        page.click(f"div.window-group a:text('{history['key']}')")
        page.wait_for_selector("p.verdict")
        assert "effect applied once" in page.locator("p.verdict").inner_text()
        browser.close()
    assert server_errors == []
    history["letter"].refresh_from_db()
    assert history["letter"].status == DeadLetterStatus.REPLAYED
    assert (shots / "dashboard.png").stat().st_size > 0
