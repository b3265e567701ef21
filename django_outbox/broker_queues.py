"""The broker's queues as an operator needs them: how many messages wait in each queue
the app knows, how many more workers hold unacknowledged (prefetched, reserved or
running), and how long the oldest has waited, read without taking a message.

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

Held by workers: a queue's depth counts only what waits in it, and a worker takes up
to its prefetch of messages at once, so a queue of 0 can still have jobs waiting in a
worker for a free process. On Redis kombu records each delivered, unacknowledged
message in its ``unacked`` hash (tag -> ``[message, exchange, routing key]``),
counted per queue the way kombu would restore it; on RabbitMQ the management API's
``messages_unacknowledged``. The management API's figures are as of its last
statistics refresh (every ``collect_statistics_interval``, 5 s by default), the
passive declare's as of now: a message delivered in between is in neither count, so
its last ``messages_ready`` is kept beside them (``reported_ready``).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Any

from celery_explicit.headers import SENT_AT_HEADER
from django_outbox.conf import settings


@dataclass(frozen=True)
class QueueState:
    name: str
    depth: int
    #: Seconds; None when the oldest message's publish time cannot be read (``why``).
    oldest_age: float | None
    why: str = ""
    #: Delivered to a worker and not yet acknowledged; None when it cannot be read
    #: (``unacked_why``).
    unacked: int | None = 0
    unacked_why: str = ""
    #: RabbitMQ: ready messages as the management API last reported them, which is up
    #: to its statistics interval (``collect_statistics_interval``, 5 s by default)
    #: older than ``depth``, as ``unacked`` is. None elsewhere, or when not read.
    reported_ready: int | None = None


def queue_states(app: Any) -> list[QueueState]:
    """Each queue the app knows (default and configured), with its depth and the age
    of its oldest message."""
    names = {str(app.conf.task_default_queue or "celery")}
    names.update(getattr(q, "name", str(q)) for q in (app.conf.task_queues or ()))
    states = []
    with app.connection_for_read() as conn:
        # One quick try: a broker that is down must not hold the page or the scrape.
        conn.ensure_connection(max_retries=1)
        held = _redis_unacked(conn) if conn.transport.driver_type == "redis" else None
        for name in sorted(n for n in names if n):
            states.append(queue_state(conn, name, held=held))
    return states


def queue_state(conn: Any, name: str, *, held: Counter[str] | None = None) -> QueueState:
    """One queue's depth, unacknowledged messages and oldest message age, on an open
    connection (``held``: Redis's unacknowledged messages per queue, read once for
    every queue by ``_redis_unacked``)."""
    channel = conn.channel()
    try:
        _, count, _ = channel.queue_declare(queue=name, passive=True)
        if conn.transport.driver_type == "amqp":
            return _rabbitmq_state(conn, name, int(count))
        age, why = _oldest_age(conn, channel, name) if count else (0.0, "")
    except conn.channel_errors:
        count, age, why = 0, 0.0, ""  # no such queue yet: nothing waits in it
    finally:
        channel.close()
    if held is None:
        held = _redis_unacked(conn) if conn.transport.driver_type == "redis" else None
    if held is None:
        return QueueState(name, int(count), age, why, None, "not readable on this transport")
    return QueueState(name=name, depth=int(count), oldest_age=age, why=why, unacked=held[name])


def _oldest_age(conn: Any, channel: Any, queue: str) -> tuple[float | None, str]:
    if conn.transport.driver_type == "redis":
        sent_at, why = _redis_sent_at(channel.client.lindex(queue, -1))
    else:
        return None, "not readable on this transport"
    return (None, why) if sent_at is None else (max(0.0, time.time() - sent_at), "")


def _redis_unacked(conn: Any) -> Counter[str]:
    """How many delivered, unacknowledged messages each queue has, from kombu's
    ``unacked`` hash (HSCAN: a worker may hold thousands). An entry is counted under
    the queues kombu would restore it to (the exchange's bindings, as ``_lookup`` in
    ``restore_by_tag`` reads them; ``_lookup`` itself would declare a queue for an
    unbound route), or under its routing key where no binding matches."""
    channel = conn.channel()
    try:
        # HSCAN is not among the commands kombu's prefixed client prefixes itself.
        key = str(getattr(channel, "global_keyprefix", "") or "") + str(channel.unacked_key)
        held: Counter[str] = Counter()
        queues_of: dict[tuple[str, str], list[str]] = {}
        for _tag, raw in channel.client.hscan_iter(key, count=500):
            try:
                _message, exchange, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                continue  # not an entry kombu wrote: nothing to count it under
            route = (str(exchange), str(routing_key))
            if route not in queues_of:
                queues_of[route] = _bound_queues(channel, *route)
            held.update(queues_of[route])
        return held
    finally:
        channel.close()


def _redis_sent_at(raw: bytes | None) -> tuple[float | None, str]:
    if raw is None:
        return None, "-"
    try:
        headers = json.loads(raw).get("headers") or {}
        return float(headers[SENT_AT_HEADER]), ""
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, "unknown (not sent by an ExplicitTask)"


def _bound_queues(channel: Any, exchange: str, routing_key: str) -> list[str]:
    if not exchange:
        return [routing_key]
    try:
        table = channel.get_table(exchange)
        found = channel.typeof(exchange).lookup(table, exchange, routing_key, None)
    except KeyError:
        found = []
    return [str(q) for q in found if q] or [routing_key]


def _rabbitmq_state(conn: Any, name: str, count: int) -> QueueState:
    """A RabbitMQ queue: its depth from the passive declare (ready messages only), the
    rest from the management API when it can be read."""
    info, why = _rabbitmq_queue_info(conn, name)
    if info is None:
        return QueueState(name, count, None if count else 0.0, why if count else "", None, why)
    held = info.get("messages_unacknowledged")
    unacked, unacked_why = (int(held), "") if isinstance(held, int) else (None, "not reported")
    ready = info.get("messages_ready")
    sent_at, why = _head_sent_at(info) if count else (None, "")
    age = 0.0 if not count else None if sent_at is None else max(0.0, time.time() - sent_at)
    return QueueState(
        name, count, age, why, unacked, unacked_why, int(ready) if isinstance(ready, int) else None
    )


def _rabbitmq_head_sent_at(conn: Any, queue: str) -> tuple[float | None, str]:
    """When ``queue``'s head message was published, from the management API."""
    info, why = _rabbitmq_queue_info(conn, queue)
    return (None, why) if info is None else _head_sent_at(info)


def _head_sent_at(info: dict[str, Any]) -> tuple[float | None, str]:
    sent_at = info.get("head_message_timestamp")
    if not isinstance(sent_at, int | float):
        return None, "unknown (its head message has no timestamp: not sent by an ExplicitTask)"
    return float(sent_at), ""


def _rabbitmq_queue_info(conn: Any, queue: str) -> tuple[dict[str, Any] | None, str]:
    """The management API's view of ``queue``, or None and why it was not read."""
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
    return (info, "") if isinstance(info, dict) else (None, "unknown (not a queue's figures)")


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
