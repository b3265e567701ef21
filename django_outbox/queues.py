"""The broker's queues as an operator needs them: how many messages wait in each queue
the app knows, and how long the oldest has waited, read without taking a message.

Depth: a passive declare on a channel of its own (RabbitMQ closes a channel whose
passive declare finds no queue). Oldest message: on Redis the queue is a list that
kombu pushes on the left and pops from the right, so the oldest message is its last
element, and its ``explicit_sent_at`` header (set on every ExplicitTask publish) says
when it was sent. AMQP cannot look at a message without taking it (a get and a requeue
would mark it redelivered), so on RabbitMQ the management API's
``head_message_timestamp`` is read: the AMQP ``timestamp`` property every ExplicitTask
publish sets (``EXPLICIT_RABBITMQ_MANAGEMENT_URL``), with the broker's credentials,
which go only over https or to this host (``credentials_refused``). The dashboard
shows these in words (``why`` says what could not be read), the metrics view as
numbers.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from celery_explicit import idempotency
from django_outbox.conf import settings


@dataclass(frozen=True)
class QueueState:
    name: str
    depth: int
    #: Seconds; None when the oldest message's publish time cannot be read (``why``).
    oldest_age: float | None
    why: str = ""


def queue_states(app: Any) -> list[QueueState]:
    """Each queue the app knows (default and configured), with its depth and the age
    of its oldest message."""
    names = {str(app.conf.task_default_queue or "celery")}
    names.update(getattr(q, "name", str(q)) for q in (app.conf.task_queues or ()))
    states = []
    with app.connection_for_read() as conn:
        # One quick try: a broker that is down must not hold the page or the scrape.
        conn.ensure_connection(max_retries=1)
        for name in sorted(n for n in names if n):
            states.append(queue_state(conn, name))
    return states


def queue_state(conn: Any, name: str) -> QueueState:
    """One queue's depth and oldest message age, on an open connection."""
    channel = conn.channel()
    try:
        _, count, _ = channel.queue_declare(queue=name, passive=True)
        age, why = _oldest_age(conn, channel, name) if count else (0.0, "")
    except conn.channel_errors:
        count, age, why = 0, 0.0, ""  # no such queue yet: nothing waits in it
    finally:
        channel.close()
    return QueueState(name=name, depth=int(count), oldest_age=age, why=why)


def _oldest_age(conn: Any, channel: Any, queue: str) -> tuple[float | None, str]:
    if conn.transport.driver_type == "amqp":
        sent_at, why = _rabbitmq_head_sent_at(conn, queue)
    elif conn.transport.driver_type == "redis":
        sent_at, why = _redis_sent_at(channel.client.lindex(queue, -1))
    else:
        return None, "not readable on this transport"
    return (None, why) if sent_at is None else (max(0.0, time.time() - sent_at), "")


def _redis_sent_at(raw: bytes | None) -> tuple[float | None, str]:
    if raw is None:
        return None, "-"
    try:
        headers = json.loads(raw).get("headers") or {}
        return float(headers[idempotency.SENT_AT_HEADER]), ""
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, "unknown (not sent by an ExplicitTask)"


def _rabbitmq_head_sent_at(conn: Any, queue: str) -> tuple[float | None, str]:
    base = settings.rabbitmq_management_url
    if base.lower() == "off":
        return None, "not read (EXPLICIT_RABBITMQ_MANAGEMENT_URL is off)"
    if not base:
        base = f"http://{conn.hostname or '127.0.0.1'}:15672"
    refused = credentials_refused(base)
    if refused:
        return None, refused
    vhost = urllib.parse.quote(conn.virtual_host or "/", safe="")
    url = f"{base.rstrip('/')}/api/queues/{vhost}/{urllib.parse.quote(queue, safe='')}"
    request = urllib.request.Request(url)
    token = base64.b64encode(f"{conn.userid or 'guest'}:{conn.password or 'guest'}".encode())
    request.add_header("Authorization", "Basic " + token.decode())
    try:
        # One second at most: a management API that is down must not hold the caller.
        with urllib.request.urlopen(request, timeout=1.0) as response:
            info = json.load(response)
    except (OSError, ValueError) as exc:
        return None, f"unknown (RabbitMQ's management API at {base} did not answer: {exc})"
    sent_at = info.get("head_message_timestamp")
    if not isinstance(sent_at, int | float):
        return None, "unknown (its head message has no timestamp: not sent by an ExplicitTask)"
    return float(sent_at), ""


def credentials_refused(base: str) -> str:
    """Why the broker's user and password may not be sent to the management API at
    ``base``, or "". They go as HTTP Basic, readable by anyone on the path unless the
    URL is https or the API is on this host: an ``amqps://`` broker does not make
    ``http://`` safe, and the management API on another host is not read."""
    parts = urllib.parse.urlsplit(base)
    if parts.scheme == "https" or _is_loopback(parts.hostname or ""):
        return ""
    return (
        f"not read (RabbitMQ's management API at {base} is plain http to another host: "
        "the broker's password would cross the network in clear; set "
        'EXPLICIT_RABBITMQ_MANAGEMENT_URL to its https:// URL, or to "off")'
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: where it resolves to is not ours to trust
