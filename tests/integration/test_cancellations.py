"""Cancellations on the database: the effect's commit refused on both commit paths, the
command's answers to what it cannot do, and the rows it keeps."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from celery_explicit import cancellation
from celery_explicit.errors import JobCancelled
from django_outbox.models import (
    Attempt,
    Cancellation,
    DeadLetter,
    DeadLetterReason,
    Outcome,
    ProcessedOperation,
)
from django_outbox.store import ledger

pytestmark = pytest.mark.django_db(transaction=True)


def cancel(*args: str) -> str:
    out = io.StringIO()
    call_command("explicit_cancel", *args, stdout=out)
    return out.getvalue().strip()


def commit(task_id: str, key: str, *, cancellable: bool) -> str:
    try:
        with ledger.effect(
            key=key,
            fingerprint="f",
            task_name="tests.ship",
            task_id=task_id,
            cancellable=cancellable,
        ):
            pass
    except JobCancelled as refused:
        assert refused.by == "alice" and key in str(refused)
        return "refused"
    return "committed"


@pytest.mark.parametrize("round_trips", [True, False], ids=["one-string-commit", "cursor"])
@pytest.mark.parametrize("by", ["task_id", "key"])
def test_a_cancelled_job_cannot_commit_its_effect(settings, round_trips: bool, by: str) -> None:
    settings.EXPLICIT_LEDGER_ROUND_TRIPS = round_trips
    task_id, key = uuid.uuid4().hex, f"ship:{uuid.uuid4().hex[:8]}"
    Cancellation.objects.create(
        task_id=task_id if by == "task_id" else "",
        idempotency_key=key if by == "key" else "",
        requested_by="alice",
        requested_at=timezone.now(),
    )
    assert commit(task_id, key, cancellable=False) == "committed"  # not declared: not read
    ProcessedOperation.objects.filter(key=key).delete()
    assert commit(task_id, key, cancellable=True) == "refused"
    assert not ProcessedOperation.objects.filter(key=key).exists()
    # Another job of another key commits beside it.
    assert commit(uuid.uuid4().hex, f"{key}-other", cancellable=True) == "committed"


def test_the_command_cancels_by_key_and_marks_the_state_store(redis_client) -> None:  # type: ignore[no-untyped-def]
    key = f"ship:{uuid.uuid4().hex[:8]}"
    said = cancel("--key", key, "--by", "alice", "--reason", "customer called")
    assert said.startswith(f"cancelled key {key} (cancellation ") and "by alice" in said
    row = Cancellation.objects.get(idempotency_key=key)
    assert (row.requested_by, row.reason, row.task_id) == ("alice", "customer called", "")
    assert cancellation.marked("some-task", key, client=redis_client) is not None
    # Again: nothing new, and it says who did it first.
    assert "already cancelled by alice" in cancel("--key", key, "--by", "bob")
    assert Cancellation.objects.filter(idempotency_key=key).count() == 1


def test_the_command_cancels_a_known_task_id() -> None:
    task_id, key = uuid.uuid4().hex, f"ship:{uuid.uuid4().hex[:8]}"
    now = timezone.now()
    Attempt.objects.create(
        task_id=task_id,
        task_name="tests.cancellable_ship",
        idempotency_key=key,
        attempt=1,
        worker_host="w@h",
        worker_pid=1,
        started_at=now,
        finished_at=now,
        duration_ms=1.0,
        outcome=Outcome.RETRY_SCHEDULED,
    )
    assert cancel(task_id, "--by", "alice").startswith(f"cancelled task {task_id}")
    assert Cancellation.objects.get(task_id=task_id).task_name == "tests.cancellable_ship"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["no-such-task"], "no job with task id no-such-task: none in the outbox"),
        ([], "name one job: its task id, or its key (--key), not both"),
        (["t", "--key", "k"], "name one job: its task id, or its key (--key), not both"),
    ],
)
def test_what_cannot_be_cancelled_is_one_line_and_exit_1(args: list[str], said: str) -> None:
    with pytest.raises(CommandError) as refused:
        cancel(*args)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert not Cancellation.objects.exists()


def test_an_effect_that_committed_cannot_be_cancelled() -> None:
    key = f"ship:{uuid.uuid4().hex[:8]}"
    assert commit("t-1", key, cancellable=True) == "committed"
    with pytest.raises(CommandError) as refused:
        cancel("--key", key, "--by", "alice")
    said = str(refused.value)
    assert said.startswith(f"cannot cancel: the effect of key {key} committed at ")
    assert "(task t-1, tests.ship" in said
    assert not Cancellation.objects.exists()


def attempt_row(task_id: str, key: str) -> Attempt:
    now = timezone.now()
    return Attempt.objects.create(
        task_id=task_id,
        task_name="tests.cancellable_ship",
        idempotency_key=key,
        attempt=1,
        worker_host="w@h",
        worker_pid=1,
        started_at=now,
        finished_at=now,
        duration_ms=1.0,
        outcome=Outcome.RETRY_SCHEDULED,
    )


def letter_row(task_id: str, key: str) -> DeadLetter:
    now = timezone.now()
    return DeadLetter.objects.create(
        task_id=task_id,
        task_name="tests.cancellable_ship",
        reason=DeadLetterReason.PERMANENT,
        idempotency_key=key,
        first_seen=now,
        last_attempt=now,
    )


def test_the_admin_cancels_the_selected_letters_jobs_by_key_and_says_what_it_could_not() -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    waiting = attempt_row(uuid.uuid4().hex, f"ship:{uuid.uuid4().hex[:8]}")
    letter = letter_row(waiting.task_id, waiting.idempotency_key)
    applied = letter_row("t-applied", f"ship:{uuid.uuid4().hex[:8]}")
    assert commit("t-applied", applied.idempotency_key, cancellable=True) == "committed"
    client = Client()
    client.force_login(User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}"))
    page = client.post(
        "/admin/django_outbox/deadletter/",
        {"action": "cancel_jobs", "_selected_action": [letter.pk, applied.pk]},
        follow=True,
    )
    said = [str(m) for m in page.context["messages"]]
    assert "Cancelled 1 job(s)." in said
    assert any(
        m.startswith(f"key {applied.idempotency_key}: cannot cancel: the effect of key")
        for m in said
    ), said
    row = Cancellation.objects.get()
    # By key: a replay of the letter (a new task id, the same key) is cancelled too.
    assert row.idempotency_key == waiting.idempotency_key and row.task_id == ""
    assert row.requested_by.startswith("oncall-")
    # The job's timeline and verdict say it.
    from tests.support.explaining import explain, verdict_of

    text = explain(waiting.idempotency_key)
    assert f"every job of key {waiting.idempotency_key} cancelled by {row.requested_by}" in text
    assert f"cancelled by {row.requested_by} at " in verdict_of(text), text


def test_the_attempt_list_cancels_the_selected_rows_jobs_by_task_id() -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    waiting = attempt_row(uuid.uuid4().hex, f"ship:{uuid.uuid4().hex[:8]}")
    client = Client()
    client.force_login(User.objects.create_superuser(f"oncall-{uuid.uuid4().hex[:6]}"))
    page = client.post(
        "/admin/django_outbox/attempt/",
        {"action": "cancel_jobs", "_selected_action": [waiting.pk]},
        follow=True,
    )
    assert "Cancelled 1 job(s)." in [str(m) for m in page.context["messages"]]
    row = Cancellation.objects.get()
    # By task id: that job (its retries keep the id), not every job of the key.
    assert row.task_id == waiting.task_id and row.idempotency_key == ""
    # Without the permission to add cancellations, the action is not offered.
    viewer = User.objects.create_user(f"viewer-{uuid.uuid4().hex[:6]}", is_staff=True)
    from django.contrib.auth.models import Permission

    viewer.user_permissions.add(Permission.objects.get(codename="view_attempt"))
    client.force_login(viewer)
    listed = client.get("/admin/django_outbox/attempt/").content.decode()
    assert "cancel_jobs" not in listed
