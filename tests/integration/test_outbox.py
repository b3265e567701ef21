"""The outbox and its relay on real PostgreSQL and Redis, with real relay processes.

Each test reads the messages the relays put in its own Redis queue (``queued``): the
broker's list is the history checked against the rows.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter as Tally
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connections, transaction
from django.test import Client, override_settings
from django.utils import timezone

from django_outbox.models import DeadLetter, DeadLetterReason, OutboxEvent, OutboxStatus
from django_outbox.outbox.dispatch import dispatch
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.loop import Relay
from tests.support.processes import ROOT, ManagedProcess
from tests.support.queues import queued
from tests.support.waiting import wait_for
from tests.testapp.tasks import Increment

pytestmark = pytest.mark.django_db(transaction=True)


def write_events(
    n: int,
    *,
    prefix: str,
    keys: int = 0,
    rollback_every: int = 0,
    seed: int = 1,
    seq: Tally[str] | None = None,
) -> tuple[list[str], list[str]]:
    """Write ``n`` Increment events in transactions of 1-5 events; some roll back.

    With ``keys``, events share that many ordering keys and number themselves per key
    in ``op_id`` (``seq`` carries the numbering across calls). Returns (committed
    event ids, rolled-back event ids), in write order.
    """
    rng = random.Random(seed)
    committed: list[str] = []
    rolled_back: list[str] = []
    seq = Tally() if seq is None else seq
    i = transactions = 0
    while i < n:
        transactions += 1
        doomed = bool(rollback_every) and transactions % rollback_every == 0
        written: list[str] = []
        try:
            with transaction.atomic():
                for _ in range(min(rng.randint(1, 5), n - i)):
                    key = f"{prefix}{rng.randrange(keys)}" if keys else ""
                    name = key or f"{prefix}{i}"
                    written.append(
                        dispatch(
                            Increment(),
                            kwargs={"name": name, "op_id": str(seq[name])},
                            durable=True,
                            ordering_key=key,
                        )
                    )
                    seq[name] += 1
                    i += 1
                if doomed:
                    raise RuntimeError("rolled back on purpose")
        except RuntimeError:
            rolled_back += written
            continue
        committed += written
    return committed, rolled_back


def published_totals(relays) -> list[int]:  # type: ignore[no-untyped-def]
    return [
        int(re.search(r"stopped: (\d+) published", r.log()).group(1))  # type: ignore[union-attr]
        for r in relays
    ]


def test_three_relays_publish_each_committed_event_exactly_once(
    start_relay, queue, redis_client
) -> None:
    relays = [start_relay("--batch-size", "10") for _ in range(3)]
    committed, rolled_back = write_events(300, prefix="once", rollback_every=7)
    wait_for(
        lambda: not OutboxEvent.objects.pending().exists(), timeout=60, what="every event relayed"
    )
    ids = Tally(m["id"] for m in queued(redis_client, queue))
    assert set(ids) == set(committed)
    assert max(ids.values()) == 1  # exactly once
    assert not set(ids) & set(rolled_back)
    assert OutboxEvent.objects.filter(status=OutboxStatus.PUBLISHED).count() == len(committed)
    assert [r.stop() for r in relays] == [0, 0, 0]
    totals = published_totals(relays)
    assert sum(totals) == len(committed)
    assert sum(1 for t in totals if t) >= 2  # the relays really shared the work


def test_events_of_one_key_are_published_in_order_across_relays(
    start_relay, queue, redis_client
) -> None:
    relays = [start_relay("--batch-size", "4") for _ in range(3)]
    # Half written before the relays can keep up (a backlog they compete for), half
    # while they run.
    seq: Tally[str] = Tally()
    with transaction.atomic():
        first, _ = write_events(120, prefix="key", keys=6, seed=2, seq=seq)
    more, _ = write_events(120, prefix="key", keys=6, seed=3, seq=seq)
    wait_for(
        lambda: not OutboxEvent.objects.pending().exists(), timeout=60, what="every event relayed"
    )
    order: dict[str, list[int]] = {}
    for message in queued(redis_client, queue):
        order.setdefault(message["kwargs"]["name"], []).append(int(message["kwargs"]["op_id"]))
    assert sum(len(s) for s in order.values()) == len(first) + len(more)
    for key, seqs in order.items():
        assert seqs == sorted(seqs), f"{key} published out of order: {seqs}"
        assert seqs == list(range(len(seqs)))  # and each exactly once
    assert [r.stop() for r in relays] == [0, 0, 0]


def test_notify_wakes_the_relay_without_polling(start_relay, queue) -> None:
    start_relay("--poll-interval", "60")
    lags = []
    for i in range(5):
        with transaction.atomic():
            event_id = publish_event("tests.note", {"name": f"wake{i}"})
        committed = time.monotonic()
        published = OutboxEvent.objects.filter(event_id=event_id, status=OutboxStatus.PUBLISHED)
        wait_for(
            published.exists,
            timeout=15,
            interval=0.01,
            what="the event published",
        )
        lags.append(time.monotonic() - committed)
    assert max(lags) < 10, lags  # woken by NOTIFY: polling would take 60 s


def test_negative_control_without_listen_an_idle_relay_waits_for_its_poll(queue) -> None:
    relay = Relay(notify_channel="", poll_interval=60)
    waiting = threading.Event()

    def ready(wakeup: Any) -> None:
        # Tell the test when the relay has made its first claim and gone to wait: an
        # event committed before that claim would be published by it, and the test
        # would fail for the wrong reason.
        wait = wakeup.wait

        def announced_wait(timeout: float) -> Any:
            waiting.set()
            return wait(timeout)

        wakeup.wait = announced_wait

    def run() -> None:
        try:
            relay.run(on_ready=ready)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert waiting.wait(10)  # its first claim found nothing; 60 s until the next
        with transaction.atomic():
            publish_event("tests.note", {"name": "unheard"}, options={"queue": queue})
        time.sleep(2)
        assert OutboxEvent.objects.get().status == OutboxStatus.PENDING
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_unknown_task_is_dead_lettered_and_does_not_block_its_key(queue, redis_client) -> None:
    with transaction.atomic():
        unknown = publish_event(
            "shop.no_such_task", {"order_id": 1}, ordering_key="order:1", options={"queue": queue}
        )
        after = publish_event(
            "tests.note", {"name": "after"}, ordering_key="order:1", options={"queue": queue}
        )
    result = Relay(poll_interval=0.1).drain()
    assert (result.dead_lettered, result.published) == (1, 1)
    letter = DeadLetter.objects.get()
    assert (letter.task_id, letter.reason) == (unknown, DeadLetterReason.UNKNOWN_TASK)
    assert "'shop.no_such_task', which is not registered" in letter.error_message
    assert letter.kwargs == {"order_id": 1}
    event = OutboxEvent.objects.get(event_id=unknown)
    assert (event.status, event.attempts) == (OutboxStatus.DEAD_LETTER, 1)
    assert "not registered" in event.last_error
    assert [m["id"] for m in queued(redis_client, queue)] == [after]


def test_one_bad_event_never_stops_the_relay(queue, redis_client) -> None:
    # Rows as an older deploy may have left them (written past today's checks).
    bad_input = OutboxEvent.objects.create(
        task_name="tests.increment", kwargs={"name": "x"}, options={"queue": queue}
    )
    failing = OutboxEvent.objects.create(
        task_name="tests.note", kwargs={"name": "f"}, options={"queue": 5}
    )
    good = [publish_in_transaction({"name": f"good{i}"}, queue) for i in range(3)]
    result = Relay(rng=LongestBackoff()).drain()
    assert (result.published, result.dead_lettered, result.failed) == (3, 1, 1)
    assert [m["id"] for m in queued(redis_client, queue)] == good
    bad_input.refresh_from_db()
    assert bad_input.status == OutboxStatus.DEAD_LETTER
    assert DeadLetter.objects.get(task_id=str(bad_input.event_id)).reason == (
        DeadLetterReason.BAD_INPUT
    )
    failing.refresh_from_db()
    assert (failing.status, failing.attempts) == (OutboxStatus.PENDING, 1)
    assert "AttributeError" in failing.last_error
    assert failing.available_at > timezone.now()  # its own backoff, not the relay's
    # Past its attempts it goes to the dead letters, and stops holding anything back.
    OutboxEvent.objects.filter(pk=failing.pk).update(available_at=timezone.now())
    with override_settings(EXPLICIT_OUTBOX_MAX_ATTEMPTS=2):
        assert Relay().drain().dead_lettered == 1
    failing.refresh_from_db()
    assert (failing.status, failing.attempts) == (OutboxStatus.DEAD_LETTER, 2)
    assert DeadLetter.objects.get(task_id=str(failing.event_id)).reason == (
        DeadLetterReason.EXHAUSTED
    )


class LongestBackoff(random.Random):
    """Full jitter drawn at its ceiling: a backoff that cannot come out as zero."""

    def uniform(self, a: float, b: float) -> float:
        return b


def publish_in_transaction(payload: dict[str, str], queue: str) -> str:
    with transaction.atomic():
        return publish_event("tests.note", payload, options={"queue": queue})


def test_prune_deletes_finished_events_older_than_the_retention() -> None:
    now = timezone.now()
    old, recent = now - timedelta(days=8), now - timedelta(days=1)

    def event(status: OutboxStatus, created: object, published: object = None) -> int:
        row = OutboxEvent.objects.create(
            task_name="tests.note", status=status, published_at=published
        )
        OutboxEvent.objects.filter(pk=row.pk).update(created_at=created)
        return row.pk

    gone = [event(OutboxStatus.PUBLISHED, old, old) for _ in range(3)]
    gone.append(event(OutboxStatus.DEAD_LETTER, old))
    kept = [
        event(OutboxStatus.PUBLISHED, old, recent),  # published yesterday
        event(OutboxStatus.PENDING, now - timedelta(days=30)),  # never pruned
        event(OutboxStatus.DEAD_LETTER, recent),
    ]
    call_command("explicit_prune", "--table", "outbox", "--older-than", "7d", "--batch-size", "2")
    assert sorted(OutboxEvent.objects.values_list("pk", flat=True)) == sorted(kept)
    assert not OutboxEvent.objects.filter(pk__in=gone).exists()


def staff(*perms: str) -> Client:
    user = User.objects.create_user(
        "op-" + "-".join(perms or ("none",)), password="pw", is_staff=True
    )
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_outboxevent", *perms]))
    client = Client()
    client.force_login(user)
    return client


def test_admin_shows_the_backlog_and_retries_now() -> None:
    changelist = "/admin/django_outbox/outboxevent/"
    with transaction.atomic():
        publish_event("tests.note", {"name": "a"})
        publish_event("tests.note", {"name": "b"})
    waiting = OutboxEvent.objects.order_by("id").last()
    assert waiting is not None
    OutboxEvent.objects.filter(pk=waiting.pk).update(
        available_at=timezone.now() + timedelta(hours=1),
        attempts=3,
        last_error="kombu.exceptions.OperationalError: broker down",
    )
    OutboxEvent.objects.filter(pk=waiting.pk - 1).update(
        created_at=timezone.now() - timedelta(minutes=5)
    )

    viewer = staff()
    page = viewer.get(changelist).content.decode()
    assert "backlog: 2 pending, oldest 5min old" in page
    assert "broker down" in page
    assert 'value="retry_now"' not in page  # its own permission
    assert viewer.get(f"{changelist}{waiting.pk}/change/").status_code == 200
    assert viewer.post(f"{changelist}{waiting.pk}/delete/", {"post": "yes"}).status_code == 403

    operator = staff("retry_outboxevent")
    assert 'value="retry_now"' in operator.get(changelist).content.decode()
    operator.post(changelist, {"action": "retry_now", "_selected_action": [str(waiting.pk)]})
    waiting.refresh_from_db()
    assert waiting.available_at <= timezone.now()
    assert waiting.attempts == 3  # the history stays


def test_sqlite_relay_polls_without_listen_notify(tmp_path: Path, queue, redis_client) -> None:
    """The demo runs on SQLite: no LISTEN/NOTIFY there, the relay polls."""
    (tmp_path / "sqlite_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(tmp_path / 'db.sqlite3')!r}}}}}\n"
    )
    from django.conf import settings

    env = {
        "DJANGO_SETTINGS_MODULE": "sqlite_settings",
        "EXPLICIT_TEST_QUEUE": queue,
        "EXPLICIT_TEST_REDIS_URL": settings.REDIS_URL,  # the Redis redis_client reads
        "PYTHONPATH": f"{tmp_path}:{ROOT}",
        "PATH": "/usr/bin:/bin",
    }

    def django(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "django", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    django("migrate", "-v", "0")
    relay = ManagedProcess(
        [sys.executable, "-m", "django", "explicit_relay", "--poll-interval", "0.2"],
        name="relay",
        log_dir=tmp_path,
        env=env,
        ready="ready",
    )
    try:
        relay.wait_ready(timeout=30)
        assert "wake-up: polling" in relay.log()
        django(
            "shell",
            "-c",
            "from django.db import transaction\n"
            "from django_outbox.outbox.events import publish_event\n"
            "with transaction.atomic():\n"
            "    print(publish_event('tests.note', {'name': 'on-sqlite'}))",
        )
        message = wait_for(lambda: queued(redis_client, queue), timeout=10, what="the message")
        assert message[0]["kwargs"] == {"name": "on-sqlite"}
        assert relay.stop(signal.SIGTERM, timeout=10) == 0
    finally:
        relay.stop(signal.SIGKILL)


def test_an_event_naming_a_missing_queue_is_its_own_failure(queue, redis_client) -> None:
    """QueueNotFound is a KeyError, which kombu's Redis transport counts as a connection
    error: it must not pass for a broker outage that holds every event back."""
    from tests.celery_app import app

    missing = OutboxEvent.objects.create(
        task_name="tests.note", kwargs={"name": "m"}, options={"queue": f"{queue}-removed"}
    )
    with transaction.atomic():  # to the default queue: the only one configured
        good = publish_event("tests.note", {"name": "good"})
    default_queue = app.conf.task_default_queue
    # The app's queue table reads task_create_missing_queues once, when first built.
    queues = app.amqp.queues
    queues.create_missing = False
    try:
        result = Relay(rng=LongestBackoff()).drain()
    finally:
        queues.create_missing = True
    try:
        assert result.broker_error is None
        assert (result.published, result.failed) == (1, 1)
        assert good in [m["id"] for m in queued(redis_client, default_queue)]
    finally:
        redis_client.delete(default_queue)
    missing.refresh_from_db()
    assert (missing.status, missing.attempts) == (OutboxStatus.PENDING, 1)
    assert "QueueNotFound" in missing.last_error


def test_a_malformed_row_is_dead_lettered_not_fatal(queue, redis_client) -> None:
    malformed = OutboxEvent.objects.create(
        task_name="tests.note",
        kwargs={"name": "x"},
        headers=["not", "a", "dict"],
        options={"queue": queue},
    )
    good = publish_in_transaction({"name": "good"}, queue)
    result = Relay().drain()
    assert (result.published, result.dead_lettered) == (1, 1)
    assert [m["id"] for m in queued(redis_client, queue)] == [good]
    letter = DeadLetter.objects.get(task_id=str(malformed.event_id))
    assert letter.reason == DeadLetterReason.BAD_INPUT
    assert "headers is list, not dict" in letter.error_message
