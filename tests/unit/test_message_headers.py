"""One function stamps our headers (``celery_explicit.headers.stamp``), and both senders
of our messages send what it stamps: ``ExplicitTask.apply_async`` and the outbox relay
(``django_outbox.outbox.relay.publish.CeleryMessages``, through its batch's own copy of
Celery's send path or through ``apply_async``). The same job, sent both ways through an
in-memory broker, is compared as Celery's ``before_task_publish`` signal shows it: a
header added to one path only fails here. The Redis wire, case by case, is compared by
tests/integration/test_relay_speed_message.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish, before_task_publish

from celery_explicit import ExplicitTask, versions
from celery_explicit.errors import BadInput
from celery_explicit.headers import (
    CORRELATION_HEADER,
    KEY_HEADER,
    PUBLISHED_VIA_HEADER,
    SENT_AT_HEADER,
    stamp,
)
from celery_explicit.sensitive import REDACTED
from django_outbox.outbox.relay.publish import CeleryMessages

OURS = {KEY_HEADER, CORRELATION_HEADER, PUBLISHED_VIA_HEADER, SENT_AT_HEADER}


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery(f"headers-{uuid.uuid4().hex[:6]}", set_as_current=False, broker="memory://")

    @app.task(
        base=ExplicitTask,
        shared=False,
        name="shop.capture_payment",
        idempotency_key="payment:{payment_id}:capture",
        visibility_timeout=60,
        expected_duration=5,
        retry_on=(),
        fail_on=(),
        sensitive=("card_number",),
    )
    def capture_payment(payment_id: int, card_number: str, amount: int = 1) -> None:
        return None

    @app.task(shared=False, name="shop.note")
    def note(text: str) -> None:
        return None

    app.finalize(auto=True)
    yield app


@pytest.fixture
def producer(app: Celery) -> Iterator[Any]:
    with app.connection_for_write() as conn:
        yield app.amqp.Producer(conn, auto_declare=False)


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """Every message published meanwhile, as ``before_task_publish`` sees it; and
    which of the two publish signals fired for it."""
    seen: list[dict[str, Any]] = []

    def before(sender: Any = None, body: Any = None, headers: Any = None, **more: Any) -> None:
        seen.append(
            {
                "signals": ["before"],
                "task": sender,
                "body": body,
                "headers": dict(headers),
                "properties": dict(more["properties"]),
                "exchange": more["exchange"],
                "routing_key": more["routing_key"],
            }
        )

    def after(sender: Any = None, headers: Any = None, **_: Any) -> None:
        # Celery sends it right after the message's before_task_publish.
        assert seen[-1]["headers"]["id"] == headers["id"]
        seen[-1]["signals"].append("after")

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(before)
        after_task_publish.disconnect(after)


def relay_and_apply_async(
    app: Celery,
    producer: Any,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    published: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """One job sent by the relay's sender, then by ``apply_async`` as the relay would
    call it, with the headers an outbox row holds; both messages, and what the relay's
    sender returned."""
    task = app.tasks[name]
    task_id = str(uuid.uuid4())
    row_headers = {PUBLISHED_VIA_HEADER: "outbox", CORRELATION_HEADER: "c-1"}
    sent = CeleryMessages(app, producer).send(
        task, task_id, args, kwargs, dict(row_headers), {"priority": 3}
    )
    task.apply_async(
        args,
        kwargs,
        task_id=task_id,
        producer=producer,
        headers=dict(row_headers),
        retry=False,
        priority=3,
    )
    relayed, applied = published[-2:]
    return relayed, applied, sent


def without_the_send_time(message: dict[str, Any]) -> dict[str, Any]:
    headers = dict(message["headers"])
    sent_at = headers.pop(SENT_AT_HEADER, None)
    properties = dict(message["properties"])
    timestamp = properties.pop("timestamp", None)
    if sent_at is not None:
        assert timestamp == int(sent_at)
    return {**message, "headers": headers, "properties": properties}


def test_the_relay_and_apply_async_send_the_same_headers(app, producer, published) -> None:
    relayed, applied, sent = relay_and_apply_async(
        app, producer, "shop.capture_payment", (7,), {"card_number": "4111"}, published
    )
    assert sent is None, "sent by the batch's own copy of Celery's send path"
    # The same headers, ours and Celery's: a header stamped on one path only fails here.
    assert sorted(relayed["headers"]) == sorted(applied["headers"])
    assert set(relayed["headers"]) >= OURS
    assert without_the_send_time(relayed) == without_the_send_time(applied)
    assert relayed["headers"][KEY_HEADER] == "payment:7:capture"
    assert relayed["headers"][PUBLISHED_VIA_HEADER] == "outbox"
    assert relayed["headers"][CORRELATION_HEADER] == "c-1"
    assert relayed["headers"]["kwargsrepr"] == repr({"card_number": REDACTED})


def test_the_relay_on_an_untested_celery_sends_through_apply_async_the_same_headers(
    app, producer, published, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its copy of Celery's send path follows the Celery it was tested with; on another,
    # the relay sends through the public path.
    monkeypatch.setattr(versions, "installed", lambda: {"celery": "5.8.0", "kombu": "5.8.0"})
    relayed, applied, sent = relay_and_apply_async(
        app, producer, "shop.capture_payment", (7,), {"card_number": "4111"}, published
    )
    assert sent is not None and sent.id == relayed["headers"]["id"]
    assert without_the_send_time(relayed) == without_the_send_time(applied)


def test_a_plain_celery_task_gets_none_of_our_headers_but_the_path(
    app, producer, published
) -> None:
    relayed, applied, _ = relay_and_apply_async(
        app, producer, "shop.note", (), {"text": "hi"}, published
    )
    assert without_the_send_time(relayed) == without_the_send_time(applied)
    assert OURS & set(relayed["headers"]) == {PUBLISHED_VIA_HEADER, CORRELATION_HEADER}


def test_the_publish_signals_fire_for_a_relayed_message(app, producer, published) -> None:
    task = app.tasks["shop.capture_payment"]
    CeleryMessages(app, producer).send(
        task, "relayed-1", (7, "4111"), {}, {PUBLISHED_VIA_HEADER: "outbox"}, {}
    )
    [message] = published
    assert message["task"] == "shop.capture_payment"
    assert message["signals"] == ["before", "after"]


def test_stamp_on_a_first_publish_and_on_a_re_publish(app) -> None:
    task = app.tasks["shop.capture_payment"]
    headers: dict[str, Any] = {}
    options: dict[str, Any] = {}
    given = stamp(task, (7,), {"card_number": "4111"}, headers, options)
    assert given == {"payment_id": 7, "card_number": "4111"}
    assert set(headers) == OURS
    assert headers[PUBLISHED_VIA_HEADER] == "direct"
    assert options["timestamp"] == int(headers[SENT_AT_HEADER])
    assert options["argsrepr"] == "(7,)"
    assert options["kwargsrepr"] == repr({"card_number": REDACTED})
    # A re-publish keeps the job's headers (republish.carry_headers put them there) and
    # gets a new send time.
    carried = {KEY_HEADER: "payment:7:capture", CORRELATION_HEADER: "c-2"}
    again: dict[str, Any] = dict(carried)
    assert stamp(task, (7,), {"card_number": "4111"}, again, {}, republish=True) is None
    assert again == {**carried, SENT_AT_HEADER: again[SENT_AT_HEADER]}


def test_stamp_takes_a_key_the_writer_rendered_without_binding_again(app) -> None:
    # The outbox's writer has bound the arguments and rendered the key (check_call):
    # the prepared message's stamp takes that key, and renders none of its own.
    task = app.tasks["shop.capture_payment"]
    headers: dict[str, Any] = {PUBLISHED_VIA_HEADER: "outbox"}
    options: dict[str, Any] = {}
    assert stamp(task, (7,), {"card_number": "4111"}, headers, options, key="k-7") is None
    assert headers[KEY_HEADER] == "k-7"
    assert headers[PUBLISHED_VIA_HEADER] == "outbox"
    assert options["timestamp"] == int(headers[SENT_AT_HEADER])
    assert options["kwargsrepr"] == repr({"card_number": REDACTED})
    # Without it the same call renders the template's key.
    rendered: dict[str, Any] = {}
    stamp(task, (7,), {"card_number": "4111"}, rendered, {})
    assert rendered[KEY_HEADER] != "k-7" and rendered[KEY_HEADER].startswith("payment:7")


def test_stamp_refuses_bad_input_before_any_header(app) -> None:
    headers: dict[str, Any] = {}
    with pytest.raises(BadInput, match=r"shop\.capture_payment"):
        stamp(app.tasks["shop.capture_payment"], (), {"card_number": "4111"}, headers, {})
    assert KEY_HEADER not in headers and SENT_AT_HEADER not in headers
