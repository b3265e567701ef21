"""The version of the code on every row a worker writes, with real workers: two workers
of two versions run jobs, and each row says which one ran it; explain, the window report
and the admin's lists show it and filter by it. The control: a row written by the other
version is never counted under this one."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from django_outbox.incident import window
from django_outbox.models import Attempt, DeadLetter, ProcessedOperation
from tests.support.explaining import explain, explain_json
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Declined, Increment

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def run_on(start_worker, version: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """A worker of ``version`` applies one Increment and dead-letters one Declined; their
    keys. The worker is stopped afterwards, so the next version runs the next jobs."""
    worker = start_worker(concurrency=1, extra_env={"EXPLICIT_APP_VERSION": version})
    op = uuid.uuid4().hex[:8]
    Counter.objects.create(name=op)
    Increment().apply_async(kwargs={"name": op, "op_id": op}, queue=worker.queue)
    payment = int(uuid.uuid4().int % 1_000_000)
    Declined().apply_async(kwargs={"payment_id": payment}, queue=worker.queue)
    applied, declined = f"counter:{op}:op:{op}", f"payment:{payment}:capture"
    wait_for(lambda: ProcessedOperation.objects.filter(key=applied).exists(), what="the effect")
    wait_for(lambda: DeadLetter.objects.filter(idempotency_key=declined).exists(), what="letter")
    worker.stop()
    return applied, declined


def test_each_row_says_which_version_wrote_it(start_worker) -> None:  # type: ignore[no-untyped-def]
    started = timezone.now()
    old = run_on(start_worker, "2026.12.1")
    new = run_on(start_worker, "2026.12.2-rc1")
    for (applied, declined), version in ((old, "2026.12.1"), (new, "2026.12.2-rc1")):
        assert Attempt.objects.get(idempotency_key=applied).app_version == version
        assert ProcessedOperation.objects.get(key=applied).app_version == version
        assert DeadLetter.objects.get(idempotency_key=declined).app_version == version
        assert Attempt.objects.get(idempotency_key=declined).app_version == version
        text = explain(applied)
        assert f"(version {version})" in text, text
        [match] = explain_json(applied)["matches"]
        [attempt] = [e for e in match["events"] if e["kind"] == "attempt"]
        assert attempt["data"]["app_version"] == version

    # The window: the deploy's dead letters and failures, each counted under its version.
    report = window.report(started - timedelta(seconds=1), timezone.now() + timedelta(seconds=1))
    [letters] = [g for g in report.groups if g.cause.startswith("dead_letter:")]
    assert letters.versions == {"2026.12.1": 1, "2026.12.2-rc1": 1}
    [line] = [x for x in report.as_text().splitlines() if x.startswith("dead-lettered")]
    by_version = report.as_text().splitlines().index(line) + 1
    assert sorted(report.as_text().splitlines()[by_version].split(": ", 1)[1].split(", ")) == [
        "2026.12.1 1x",
        "2026.12.2-rc1 1x",
    ]
    assert report.as_json()["groups"][0]["versions"]  # type: ignore[index]

    # The admin's lists, filtered by one version: only that version's rows.
    client = Client()
    client.force_login(User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}"))
    page = client.get("/admin/django_outbox/attempt/", {"app_version": "2026.12.2-rc1"})
    assert page.status_code == 200
    listed = {a.idempotency_key for a in page.context["cl"].result_list}
    assert listed == set(new)
    page = client.get("/admin/django_outbox/deadletter/", {"app_version": "2026.12.1"})
    assert {d.idempotency_key for d in page.context["cl"].result_list} == {old[1]}
