"""The broker's credentials go to RabbitMQ's management API only over https or to this
host (``django_outbox.broker_queues``); otherwise the API is not asked, and the reason is what
the dashboard shows for the queue's oldest message."""

from __future__ import annotations

import io
import json
import urllib.request
from typing import Any

import pytest
from django.test import override_settings
from kombu import Connection

from django_outbox import broker_queues


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[urllib.request.Request]:
    """Every request the module would send, answered with a head message sent at 1000."""
    sent: list[urllib.request.Request] = []

    def urlopen(request: urllib.request.Request, timeout: float) -> Any:
        sent.append(request)
        return io.BytesIO(json.dumps({"head_message_timestamp": 1000}).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return sent


def test_plain_http_to_another_host_with_credentials_is_not_attempted(
    requests: list[urllib.request.Request],
) -> None:
    conn = Connection("amqps://shop:s3cret@rabbit.example.com:5671//")
    sent_at, why = broker_queues._rabbitmq_head_sent_at(conn, "celery")
    assert requests == []
    assert sent_at is None
    assert why == (
        "not read (RabbitMQ's management API at http://rabbit.example.com:15672 is plain "
        "http to another host: the broker's password would cross the network in clear; "
        'set EXPLICIT_RABBITMQ_MANAGEMENT_URL to its https:// URL, or to "off")'
    )
    with override_settings(EXPLICIT_RABBITMQ_MANAGEMENT_URL="http://10.0.0.7:15672"):
        sent_at, why = broker_queues._rabbitmq_head_sent_at(conn, "celery")
    assert requests == []
    assert "http://10.0.0.7:15672 is plain http to another host" in why


@pytest.mark.parametrize(
    ("broker", "management", "url"),
    [
        ("amqp://shop:s3cret@127.0.0.1//", "", "http://127.0.0.1:15672/api/queues/%2F/celery"),
        ("amqp://shop:s3cret@localhost//", "", "http://localhost:15672/api/queues/%2F/celery"),
        (
            "amqps://shop:s3cret@rabbit.example.com//",
            "https://rabbit.example.com:15671",
            "https://rabbit.example.com:15671/api/queues/%2F/celery",
        ),
        (
            "amqp://shop:s3cret@[::1]//",
            "http://[::1]:15672",
            "http://[::1]:15672/api/queues/%2F/celery",
        ),
    ],
)
def test_https_or_loopback_is_asked_with_the_credentials(
    requests: list[urllib.request.Request], broker: str, management: str, url: str
) -> None:
    with override_settings(EXPLICIT_RABBITMQ_MANAGEMENT_URL=management):
        sent_at, why = broker_queues._rabbitmq_head_sent_at(Connection(broker), "celery")
    assert (sent_at, why) == (1000.0, "")
    [request] = requests
    assert request.full_url == url
    assert request.get_header("Authorization") == "Basic c2hvcDpzM2NyZXQ="  # shop:s3cret


@pytest.mark.parametrize(
    ("base", "refused"),
    [
        ("http://127.0.0.1:15672", False),
        ("http://127.8.0.1:15672", False),
        ("http://rabbit.localhost:15672", False),
        ("https://rabbit.example.com", False),
        ("http://rabbit.example.com:15672", True),
        ("http://localhost.example.com:15672", True),
        ("HTTP://192.168.1.4:15672", True),
    ],
)
def test_what_counts_as_safe(base: str, refused: bool) -> None:
    assert bool(broker_queues.credentials_refused(base)) is refused
