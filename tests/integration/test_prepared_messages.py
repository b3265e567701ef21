"""Prepared outbox messages (``django_outbox.outbox.prepared``) are what the relay sends.

With ``EXPLICIT_OUTBOX_PREPARED_MESSAGES`` the writer stores each event's broker message
and the relay pushes those bytes. These tests hold the two ends to the relay's own send
path: the same event built at write time and sent by the relay's builder, compared as a
worker receives them (all but the send time and delivery tag); the cases where no
message may be stored; a relay batch of stored, unstored and unreadable rows; the
publish signals; and a real worker applying prepared events once each.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from django.db import transaction
from django.test import override_settings
from kombu import Exchange, Queue

from celery_explicit.headers import PUBLISHED_VIA_HEADER, SENT_AT_HEADER
from django_outbox.models import DeadLetter, OutboxEvent, OutboxStatus
from django_outbox.outbox import prepared
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.loop import Relay
from django_outbox.outbox.relay.publish import CeleryMessages
from tests.celery_app import app
from tests.integration.test_relay_speed_message import comparable, raw_messages
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import CapturePayment, Increment

PREPARED = override_settings(EXPLICIT_OUTBOX_PREPARED_MESSAGES=True)


@pytest.fixture
def producer() -> Iterator[Any]:
    with app.connection_for_write() as conn:
        yield app.amqp.Producer(conn, auto_declare=False)


def prepare(task_name: str, args: Any = (), kwargs: Any = None, **options: Any) -> Any:
    """What the writer stores for one event of ``task_name`` (None: nothing)."""
    headers = {"explicit_correlation_id": uuid.uuid4().hex}
    return prepared.prepare(
        app.tasks[task_name], str(uuid.uuid4()), tuple(args), dict(kwargs or {}), headers, options
    )


CASES: dict[str, Callable[[str], tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any]]]] = {
    "explicit task, keyword arguments": lambda q: (
        Increment.name, (), {"name": "c", "op_id": "o1"}, {"queue": q}
    ),
    "explicit task, positional arguments": lambda q: (
        Increment.name, ("c", "o2"), {}, {"queue": q}
    ),
    "strings saferepr shows unlike repr": lambda q: (
        Increment.name, (), {"name": 'it\'s "x"\n\\', "op_id": "o3", "amount": 2}, {"queue": q}
    ),
    "a decorator task": lambda q: (
        "tests.note", (), {"name": "n", "request_id": "r"}, {"queue": q}
    ),
    "sensitive arguments": lambda q: (
        CapturePayment.name, (), {"payment_id": 7, "card_number": "4111111111111111"}, {"queue": q}
    ),
    "a routing key and no queue": lambda q: (
        Increment.name, (), {"name": "c", "op_id": "o4"}, {"routing_key": q}
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_prepared_message_is_what_the_relay_sends(
    case: str, producer: Any, redis_client: redis.Redis, queue: str
) -> None:
    task_name, args, kwargs, options = CASES[case](queue)
    if "routing_key" in options:
        # No queue named: Celery's default queue, with the routing key as given.
        app.amqp.queues.select_add(Queue(queue, routing_key=queue))
        options = {"queue": queue, **options}
    task = app.tasks[task_name]
    task_id = str(uuid.uuid4())
    headers = {"explicit_correlation_id": uuid.uuid4().hex}
    stored = prepared.prepare(task, task_id, args, kwargs, dict(headers), dict(options))
    assert stored is not None, f"{case}: no message prepared"
    assert prepared.readable(stored.format) and "celery-explicit" in stored.format
    sent_at = time.time()
    key, payload = prepared.splice(stored.message, sent_at, str(uuid.uuid4()))
    assert key == queue
    redis_client.lpush(key, payload)
    messages = CeleryMessages(app, producer)
    messages.send(task, task_id, args, kwargs, {PUBLISHED_VIA_HEADER: "outbox", **headers}, options)
    pushed, built = raw_messages(redis_client, queue)
    assert pushed["headers"][SENT_AT_HEADER] == sent_at
    # comparable() drops the send time: each side must carry it.
    assert SENT_AT_HEADER in built["headers"] and "timestamp" in built["properties"]
    assert comparable(pushed) == comparable(built)


def test_no_message_where_the_bytes_are_not_the_whole_publish(queue: str) -> None:
    plain = ("tests.note", (), {"name": "n", "request_id": "r"})
    assert prepare(*plain, queue=queue) is not None  # the control: this one is stored
    # A plain Celery task: its message carries no send time for the relay to splice.
    unguarded = {"name": "u", "op_id": "1"}
    assert prepare("tests.increment_unguarded", kwargs=unguarded, queue=queue) is None
    # Compression, set through Django's settings: read again at once.
    with override_settings(CELERY_TASK_COMPRESSION="gzip"):
        assert prepare(*plain, queue=queue) is None
    assert prepare(*plain, queue=queue) is not None
    # Another Redis list (kombu keeps each priority in its own).
    assert prepare(*plain, queue=queue, priority=5) is None
    # A dedup id or an ordering number is claimed at the publish.
    assert prepare("tests.record_event", kwargs={"event_id": "e", "name": "d"}, queue=queue) is None
    assert prepare("tests.apply_order_event", kwargs=_order_event(), queue=queue) is None
    # A queue that expires is re-armed by every publish (PEXPIRE beside the LPUSH).
    expiring = f"{queue}-expiring"
    app.amqp.queues.select_add(Queue(expiring, expires=60))
    assert prepare(*plain, queue=expiring) is None
    # A topic exchange: the broker's bindings route it, not the queue's name.
    topical = f"{queue}-topic"
    app.amqp.queues.select_add(Queue(topical, Exchange("shop", type="topic"), routing_key="s.#"))
    assert prepare(*plain, queue=topical) is None
    # Someone listens to before_task_publish here: it may change what is sent.
    seen: list[Any] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs)

    before_task_publish.connect(receiver)
    try:
        assert prepare(*plain, queue=queue) is None
    finally:
        before_task_publish.disconnect(receiver)
    assert seen == []  # and it was not fired at the write either
    # A broker other than Redis.
    other = Celery("other", broker="amqp://guest:guest@127.0.0.1:5672//")
    assert prepared._Writer.of(other) is None
    assert prepared._Writer.of(app) is not None  # the control: this app's broker is Redis


def _order_event() -> dict[str, Any]:
    return {"order_id": 1, "seq": 1, "tag": "t"}


def write(task_name: str, queue: str, n: int, *, prepared_on: bool) -> list[str]:
    with override_settings(EXPLICIT_OUTBOX_PREPARED_MESSAGES=prepared_on), transaction.atomic():
        return [
            publish_event(
                task_name,
                {"name": f"c{uuid.uuid4().hex[:6]}", "op_id": "1"},
                options={"queue": queue},
            )
            for _ in range(n)
        ]


@pytest.fixture
def pushed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The event ids whose stored message a relay in this process pushed."""
    ids: list[str] = []
    push = CeleryMessages.push

    def spy(self: CeleryMessages, event: Any, task: Any) -> None:
        push(self, event, task)
        ids.append(event.event_id)

    monkeypatch.setattr(CeleryMessages, "push", spy)
    return ids


@pytest.mark.django_db(transaction=True)
def test_a_relay_batch_of_stored_unstored_and_unreadable_messages(
    queue: str, redis_client: redis.Redis, pushed: list[str]
) -> None:
    written_at = time.time()
    stored = write(Increment.name, queue, 3, prepared_on=True)
    unstored = write(Increment.name, queue, 2, prepared_on=False)
    assert OutboxEvent.objects.exclude(message="").count() == 3  # the control: stored
    assert set(
        OutboxEvent.objects.exclude(message="").values_list("message_format", flat=True)
    ) == {prepared.format_label()}
    newer, garbled = write(Increment.name, queue, 2, prepared_on=True)
    OutboxEvent.objects.filter(event_id=newer).update(
        message_format="kombu-redis-json/9 celery-explicit 9.9.9"
    )
    OutboxEvent.objects.filter(event_id=garbled).update(message="not\na prepared message")
    time.sleep(0.01)
    relay = Relay(batch_size=50, notify_channel="")
    try:
        result = relay.drain()
    finally:
        relay.close()
    assert (result.published, result.dead_lettered) == (5, 2), result
    assert sorted(pushed) == sorted(stored)  # pushed as stored; the others built
    sent = raw_messages(redis_client, queue)
    assert sorted(m["headers"]["id"] for m in sent) == sorted(stored + unstored)
    assert len({m["properties"]["delivery_tag"] for m in sent}) == 5
    for message in sent:
        # Sent when the relay sent it, not when the row was written.
        assert message["headers"][SENT_AT_HEADER] > written_at
        assert message["properties"]["timestamp"] == int(message["headers"][SENT_AT_HEADER])
        assert message["headers"]["idempotency_key"].startswith("counter:")
    letters = {d.task_id: d for d in DeadLetter.objects.all()}
    assert set(letters) == {newer, garbled}
    assert "celery-explicit 9.9.9" in letters[newer].error_message
    assert "kombu-redis-json/9" in letters[newer].error_message
    assert letters[newer].kwargs["op_id"] == "1"  # the arguments go with the dead letter
    assert "not in its format" in letters[garbled].error_message
    assert OutboxEvent.objects.filter(status=OutboxStatus.DEAD_LETTER).count() == 2
    # A published row's message is spent: cleared, its label kept.
    published = OutboxEvent.objects.filter(event_id__in=stored)
    assert {(e.status, e.message, e.message_format) for e in published} == {
        (OutboxStatus.PUBLISHED, "", prepared.format_label())
    }


@pytest.mark.django_db(transaction=True)
def test_a_prepared_rows_columns_are_read_only_when_its_message_is_built(
    queue: str, redis_client: redis.Redis, pushed: list[str]
) -> None:
    """The relay pushes a stored message without parsing the row's JSON columns: a row
    whose args column no longer has the relay's shape still goes out as stored. Built
    instead (a before_task_publish receiver), the same row is a bad_input dead letter
    naming the column, as an unstored one is."""
    stored = write(Increment.name, queue, 2, prepared_on=True)
    OutboxEvent.objects.filter(event_id__in=stored).update(args={"not": "a list"})
    relay = Relay(batch_size=50, notify_channel="")
    try:
        assert relay.drain().published == 2
        assert sorted(pushed) == sorted(stored)
        sent = raw_messages(redis_client, queue)
        assert sorted(m["headers"]["id"] for m in sent) == sorted(stored)

        built = write(Increment.name, queue, 2, prepared_on=True)
        unstored = write(Increment.name, queue, 1, prepared_on=False)
        OutboxEvent.objects.filter(event_id__in=built + unstored).update(args={"not": "a list"})
        before_task_publish.connect(_ignore)
        try:
            result = relay.drain()
        finally:
            before_task_publish.disconnect(_ignore)
    finally:
        relay.close()
    assert (result.published, result.dead_lettered) == (0, 3), result
    assert sorted(pushed) == sorted(stored)
    letters = DeadLetter.objects.filter(task_id__in=built + unstored)
    assert letters.count() == 3
    assert {letter.error_message for letter in letters} == {
        "outbox event columns have the wrong shape: args is dict, not list"
    }


def _ignore(**kwargs: Any) -> None:
    """A before_task_publish receiver: its presence makes the relay build messages."""


@pytest.mark.django_db(transaction=True)
def test_the_publish_signals_fire_where_documented(
    queue: str, redis_client: redis.Redis, pushed: list[str]
) -> None:
    """after_task_publish fires in the relay for a prepared message; a before_task_publish
    receiver in the relay sees every message, built as before, and what it changes is sent."""
    before: list[str] = []
    after: list[tuple[str, Any, str]] = []
    after_bodies: list[Any] = []

    def on_before(headers: dict[str, Any], **kwargs: Any) -> None:
        before.append(headers["id"])
        headers["seen_by"] = "before"

    def on_after(headers: dict[str, Any], body: Any, routing_key: str, **kwargs: Any) -> None:
        after.append((headers["id"], body[1], routing_key))
        after_bodies.append(body)

    first = write(Increment.name, queue, 2, prepared_on=True)
    after_task_publish.connect(on_after)
    try:
        relay = Relay(batch_size=50, notify_channel="")
        assert relay.drain().published == 2
        assert sorted(pushed) == sorted(first)
        assert before == []
        assert sorted(a[0] for a in after) == sorted(first)
        assert all(a[1]["op_id"] == "1" and a[2] == queue for a in after), after
        assert all(isinstance(body, tuple) for body in after_bodies)
        sent = raw_messages(redis_client, queue)
        assert all("seen_by" not in m["headers"] for m in sent)
        redis_client.delete(queue)

        second = write(Increment.name, queue, 2, prepared_on=True)
        assert OutboxEvent.objects.filter(event_id__in=second).exclude(message="").count() == 2
        before_task_publish.connect(on_before)
        try:
            assert relay.drain().published == 2
        finally:
            before_task_publish.disconnect(on_before)
        assert sorted(pushed) == sorted(first)  # the second pair built, not pushed
        relay.close()
    finally:
        after_task_publish.disconnect(on_after)
    assert sorted(before) == sorted(second)
    sent = raw_messages(redis_client, queue)
    assert sorted(m["headers"]["id"] for m in sent) == sorted(second)
    assert all(m["headers"]["seen_by"] == "before" for m in sent)


@pytest.mark.worker
def test_a_worker_applies_prepared_events_once_each(
    start_worker, queue: str, pushed: list[str]
) -> None:
    """Each event twice in the outbox (two rows, one idempotency key): one effect each."""
    names = [f"p{i}" for i in range(20)]
    Counter.objects.bulk_create(Counter(name=n) for n in names)
    with PREPARED, transaction.atomic():
        for name in names * 2:
            publish_event(Increment.name, {"name": name, "op_id": "1"}, options={"queue": queue})
    assert OutboxEvent.objects.filter(message="").count() == 0
    relay = Relay(batch_size=50, notify_channel="")
    assert relay.drain().published == 40
    assert len(pushed) == 40
    relay.close()
    start_worker(concurrency=2)
    wait_for(
        lambda: sum(Counter.objects.filter(name__in=names).values_list("value", flat=True)) >= 20,
        timeout=60,
        what="the effects",
    )
    time.sleep(1)  # the duplicates' deliveries, which must change nothing
    assert dict(Counter.objects.filter(name__in=names).values_list("name", "value")) == {
        n: 1 for n in names
    }


def test_stored_text_is_three_lines_and_splices_to_json(queue: str) -> None:
    stored = prepare("tests.note", kwargs={"name": "line\nbreak", "request_id": "r"}, queue=queue)
    assert stored.message.count("\n") == 2  # the argument's newline is escaped in JSON
    key, payload = prepared.splice(stored.message, 1765000000.25, "t" * 36)
    message = json.loads(payload)
    assert key == queue
    assert message["headers"][SENT_AT_HEADER] == 1765000000.25
    assert message["properties"]["timestamp"] == 1765000000
    assert message["properties"]["delivery_tag"] == "t" * 36
