"""The relay's own message building sends what ``task.apply_async`` sent, byte for byte.

The relay sends each event's Celery message through its batch's own copy of Celery's
send path (``outbox.relay.celery_send``) instead of calling ``task.apply_async``, for
speed (bench/relay_throughput.py). These
tests publish the same event both ways into one Redis queue and compare the two
messages as a worker receives them: body, headers and properties, all but the send
time. A Celery upgrade that changes what ``apply_async`` sends fails here.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery.signals import after_task_publish, before_task_publish
from celery.utils.saferepr import saferepr

from celery_explicit.headers import PUBLISHED_VIA_HEADER, SENT_AT_HEADER
from django_outbox.models import OutboxStatus
from django_outbox.outbox.relay.celery_send import Batch, Plan
from django_outbox.outbox.relay.claim import Claimed
from django_outbox.outbox.relay.publish import CeleryMessages
from tests.celery_app import app
from tests.testapp.tasks import (
    ApplyOrderEvent,
    CapturePayment,
    Increment,
    Overrun,
    RecordEvent,
)


@pytest.fixture
def producer() -> Iterator[Any]:
    with app.connection_for_write() as conn:
        yield app.amqp.Producer(conn, auto_declare=False)


def raw_messages(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The queue's messages, oldest first, with the body decoded. kombu's Redis
    transport keeps a priority's messages in a list of their own (``<queue>\\x06\\x16<n>``)."""
    out = []
    lists = [queue, *(f"{queue}\x06\x16{n}" for n in range(1, 10))]
    raws = [raw for name in lists for raw in reversed(client.lrange(name, 0, -1))]
    for name in lists[1:]:
        client.delete(name)
    for raw in raws:
        envelope = json.loads(raw)
        envelope["body"] = json.loads(base64.b64decode(envelope["body"]))
        out.append(envelope)
    return out


def comparable(envelope: dict[str, Any]) -> dict[str, Any]:
    """All of a message but the moment it was sent (and kombu's own delivery tag)."""
    headers = dict(envelope["headers"])
    sent_at = headers.pop(SENT_AT_HEADER, None)
    properties = dict(envelope["properties"])
    properties.pop("delivery_tag")
    timestamp = properties.pop("timestamp", None)
    if sent_at is not None:
        assert timestamp == int(sent_at)
    return {**envelope, "headers": headers, "properties": properties}


def claimed(task_name: str, *, args: Any = (), kwargs: Any = None, **columns: Any) -> Claimed:
    headers = {"explicit_correlation_id": uuid.uuid4().hex, **columns.pop("headers", {})}
    return Claimed(
        id=1,
        event_id=str(uuid.uuid4()),
        task_name=task_name,
        stored=(list(args), dict(kwargs or {}), headers, columns.pop("options", {})),
        ordering_key="",
        attempts=0,
        created_at=datetime.now(UTC),
    )


def both_ways(event: Claimed, producer: Any, client: redis.Redis, queue: str) -> list[Any]:
    """The event sent by the relay's builder, then by ``apply_async`` as the relay used
    to call it; both messages, comparable."""
    client.delete(queue)
    task = app.tasks[event.task_name]
    messages = CeleryMessages(app, producer)
    assert messages.celery.plan(task) is not None, "this task takes the relay's own path"
    headers = {PUBLISHED_VIA_HEADER: "outbox", **event.headers}
    sent = messages.send(
        task, event.event_id, tuple(event.args), event.kwargs, dict(headers), event.options
    )
    assert sent is None, "sent by the batch's own path, not by apply_async"
    task.apply_async(
        tuple(event.args),
        event.kwargs,
        task_id=event.event_id,
        producer=producer,
        headers=dict(headers),
        retry=False,
        **event.options,
    )
    sent = raw_messages(client, queue)
    assert len(sent) == 2
    client.delete(queue)
    return [comparable(m) for m in sent]


CASES = {
    "explicit task, keyword arguments": lambda q: claimed(
        Increment.name, kwargs={"name": "c", "op_id": "o1"}, options={"queue": q}
    ),
    "explicit task, positional arguments and a priority": lambda q: claimed(
        Increment.name, args=["c", "o2"], options={"queue": q, "priority": 3}
    ),
    "strings saferepr shows unlike repr": lambda q: claimed(
        Increment.name,
        kwargs={"name": 'it\'s "x"\n\\', "op_id": "o3", "amount": 2},
        options={"queue": q},
    ),
    "a decorator task": lambda q: claimed(
        "tests.note", kwargs={"name": "n", "request_id": "r"}, options={"queue": q}
    ),
    "a nested argument": lambda q: claimed(
        "tests.increment_unguarded",
        kwargs={"name": {"a": [1, {"b": [2, [3, [4]]]}]}, "op_id": "o6"},
        options={"queue": q},
    ),
    "sensitive arguments": lambda q: claimed(
        CapturePayment.name,
        kwargs={"payment_id": 7, "card_number": "4111111111111111"},
        options={"queue": q},
    ),
    "time limits from max_run_time": lambda q: claimed(
        Overrun.name, kwargs=_overrun_kwargs(), options={"queue": q}
    ),
    "a plain Celery task": lambda q: claimed(
        "tests.increment_unguarded",
        kwargs={"name": "c", "op_id": "o4"},
        options={"queue": q},
        headers={"idempotency_key": "stored"},
    ),
    "a queue of its own and a routing key": lambda q: claimed(
        Increment.name,
        kwargs={"name": "c", "op_id": "o5"},
        options={"queue": q, "routing_key": q},
    ),
}


def _overrun_kwargs() -> dict[str, Any]:
    import inspect

    params = inspect.signature(Overrun().run).parameters
    return {name: 1 for name in params if params[name].default is inspect.Parameter.empty}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_relay_sends_what_apply_async_sent(case: str, producer, redis_client, queue) -> None:
    ours, celerys = both_ways(CASES[case](queue), producer, redis_client, queue)
    assert ours == celerys


def test_the_publish_signals_see_the_same_message(producer, redis_client, queue) -> None:
    seen: list[tuple[str, Any]] = []

    def before(sender: Any = None, headers: Any = None, routing_key: Any = None, **_: Any) -> None:
        seen.append(("before", (sender, routing_key, sorted(headers))))

    def after(sender: Any = None, headers: Any = None, routing_key: Any = None, **_: Any) -> None:
        seen.append(("after", (sender, routing_key, sorted(headers))))

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    try:
        both_ways(
            claimed(Increment.name, kwargs={"name": "c", "op_id": "s"}, options={"queue": queue}),
            producer,
            redis_client,
            queue,
        )
    finally:
        before_task_publish.disconnect(before)
        after_task_publish.disconnect(after)
    assert [kind for kind, _ in seen] == ["before", "after", "before", "after"]
    assert seen[0] == seen[2] and seen[1] == seen[3]


def test_a_task_claiming_redis_state_at_publish_keeps_apply_async() -> None:
    # A dedup id or an ordering number is claimed by ExplicitTask.apply_async itself.
    assert Plan.of(app.tasks[RecordEvent.name]) is None
    assert Plan.of(app.tasks[ApplyOrderEvent.name]) is None
    assert Plan.of(app.tasks[Increment.name]) is not None


@pytest.mark.django_db(transaction=True)
def test_a_deduplicating_task_still_publishes_through_apply_async(
    producer, redis_client, queue
) -> None:
    from django_outbox.outbox.relay.loop import Relay

    relay = Relay(notify_channel="", app=app)
    messages = relay.policy.messages(producer)
    event_id = f"e-{uuid.uuid4().hex}"
    first, second = (
        claimed(
            RecordEvent.name, kwargs={"event_id": event_id, "name": "c"}, options={"queue": queue}
        )
        for _ in range(2)
    )
    assert relay.policy.publish(first, messages) is OutboxStatus.PUBLISHED
    assert relay.policy.publish(second, messages) is OutboxStatus.DEDUPLICATED
    relay.close()
    assert [m["headers"]["id"] for m in raw_messages(redis_client, queue)] == [first.event_id]


def test_the_plans_live_for_one_batch(producer) -> None:
    # Built per batch: a changed setting or task is seen by the next batch, and the
    # cache holds at most the task names of one batch.
    batch = Batch(app, producer)
    batch.plan(app.tasks[Increment.name])
    assert list(batch._plans) == [Increment.name]
    assert Batch(app, producer)._plans == {}


@pytest.mark.parametrize(
    "value",
    [
        (),
        {},
        {"a": 1, "b": 2.5, "c": None, "d": True, "e": "plain", "f": "é☃"},
        ("x", 10**30, -0.0, float("inf")),
        {"q": "it's"},
        {"q": 'say "hi"'},
        {"q": "back\\slash"},
        {"q": "new\nline"},
        {"nested": {"a": [1, 2, {"b": 3}]}},
        {"long": "x" * 2000},
        {"k": "y" * 1000},
    ],
)
def test_the_argument_repr_is_saferepr(value: Any, producer) -> None:
    batch = Batch(app, producer)
    expected = saferepr(value, 1024, maxlevels=batch.repr_levels)
    assert batch._repr(value, 1024) == expected
