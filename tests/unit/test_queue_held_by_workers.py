"""A RabbitMQ queue's messages held by workers come from the management API's
``messages_unacknowledged``, asked even when nothing waits in the queue (all of it may
sit prefetched in a worker). The HTTP answer is the API's shape; the Redis side is
tested against a real worker (tests/integration/test_dashboard.py)."""

from __future__ import annotations

import io
import json
import time
import urllib.request
from typing import Any

import pytest
from django.test import override_settings
from kombu import Connection

from django_outbox import broker_queues


@pytest.fixture
def answer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    figures: dict[str, Any] = {}

    def urlopen(request: urllib.request.Request, timeout: float) -> Any:
        return io.BytesIO(json.dumps(figures).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return figures


def test_unacknowledged_are_read_even_when_nothing_waits(answer: dict[str, Any]) -> None:
    conn = Connection("amqp://guest:guest@127.0.0.1//")
    answer.update(messages_unacknowledged=3, head_message_timestamp=int(time.time()) - 300)
    with override_settings(EXPLICIT_RABBITMQ_MANAGEMENT_URL=""):
        waiting = broker_queues._rabbitmq_state(conn, "celery", 2)
        empty = broker_queues._rabbitmq_state(conn, "celery", 0)
    assert (waiting.depth, waiting.unacked, waiting.unacked_why) == (2, 3, "")
    assert waiting.oldest_age is not None and 299 <= waiting.oldest_age < 330
    assert (empty.depth, empty.unacked, empty.oldest_age, empty.why) == (0, 3, 0.0, "")


def test_unread_is_said_not_zero(answer: dict[str, Any]) -> None:
    conn = Connection("amqp://guest:guest@127.0.0.1//")
    with override_settings(EXPLICIT_RABBITMQ_MANAGEMENT_URL="off"):
        state = broker_queues._rabbitmq_state(conn, "celery", 0)
    assert state.unacked is None
    assert state.unacked_why == "not read (EXPLICIT_RABBITMQ_MANAGEMENT_URL is off)"
