"""Prepared messages: an outbox event's broker message, built when the event is written.

With ``EXPLICIT_OUTBOX_PREPARED_MESSAGES = True`` (a Redis broker only: check
django_outbox.E009) the writer builds each event's message in its own transaction, the
bytes kombu's Redis transport would push for it, and stores them on the row
(``OutboxEvent.message``, with ``message_format``). The relay then claims, pushes those
bytes in one Redis pipeline, marks and commits: no Celery or kombu work per event, and
none of ours but three string joins. ``scripts/bench relay_throughput.py``: the relay
publishes two to three times as many events a second (P3b in docs/performance.md); the
writer spends about one and a half times the CPU an event, and a row carries about
1 kB more.

**What is built.** Celery's message, by the relay's own send path
(``celery_send.Batch.build``: our headers stamped by ``celery_explicit.headers.stamp``,
``create_task_message``, the route resolved), then what Celery's
``send_task_message`` and kombu's ``Producer.publish``, ``Channel.prepare_message``,
``_inplace_augment_message`` and the Redis ``_put`` do with it, written out here
(``envelope``) from kombu's own serializer, body codec and JSON encoder.
``tests/integration/test_prepared_messages.py`` compares it with what the relay's send
path pushes for the same event. Three values belong to the publish, not the write: the delivery tag
(each delivery's own), the ``explicit_sent_at`` header and the ``timestamp`` property
(when it was sent). They are left out of the stored text and spliced in by the relay
(``splice``), at fixed places: the stored text is the Redis list's name, the message
up to the end of its headers, and its properties without their closing brace, one per
line (kombu's JSON never holds a raw newline).

**Only where the bytes are the whole publish**, else no message is stored and the relay
builds it from the row's columns as for every other event: an ExplicitTask the relay's
own send path takes (``celery_send.Plan.of``: no dedup id or ordering number to claim,
no ``apply_async`` of its own, no expiry; Celery not eager, sending no task events, a
tested version); a route that ends in one Redis list (a direct exchange, which Celery
sends to the queue by name; no priority; no ``x-expires``); no compression; the
transport's default body encoding (base64); no ``before_task_publish`` or ``task_sent``
receiver in the writer. The relay, for its part, uses a stored message only when
nothing in it listens to ``before_task_publish`` or ``task_sent`` (a receiver may change
or need what is sent: it then sees every message, built as before), tracing is off (a
span per publish needs the message built), and its broker is Redis.

**Signals.** ``before_task_publish`` fires for no prepared message (above: none is
used where a receiver listens); ``after_task_publish`` fires in the relay for each,
once its pipeline has run, with the event's body, headers, exchange and routing key.

**A format the relay does not read** (a row written by another version of the package
whose stored message this one cannot splice) is dead-lettered ``bad_input`` with the
version that wrote it, never published half-read; its arguments stay on the row for a
replay. A row with no message (written before the setting, or by a writer that could
not prepare it) is published as before. The message is what the route was when the
event was written: a route changed later applies to events written after it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task, signals
from django.core.signals import setting_changed
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps as serialize
from kombu.transport.virtual.base import Base64
from kombu.utils.json import dumps

from celery_explicit.headers import PUBLISHED_VIA_HEADER, SENT_AT_HEADER
from celery_explicit.versions import __version__
from django_outbox.checks.broker import REDIS_URL_SCHEMES
from django_outbox.outbox.relay.celery_send import Batch, Plan

__all__ = [
    "FORMAT",
    "Prepared",
    "Unreadable",
    "envelope",
    "format_label",
    "prepare",
    "readable",
    "splice",
    "version_of",
]

#: The layout of a stored message this version writes and reads: kombu's Redis
#: envelope as JSON, split in three lines (``splice``).
FORMAT = "kombu-redis-json/1"

# kombu's Redis transport's defaults, which the stored bytes bake in.
_BODY_ENCODING = "base64"


def format_label() -> str:
    """The ``message_format`` a row is written with: the layout and who wrote it."""
    return f"{FORMAT} celery-explicit {__version__}"


def readable(label: str) -> bool:
    """Whether this version splices a message stored with ``label``."""
    return label.split(" ", 1)[0] == FORMAT


def version_of(label: str) -> str:
    """Who wrote a stored message, as its label says (for a dead letter's message)."""
    layout, _, writer = label.partition(" ")
    return f"{writer or 'an unknown writer'} (format {layout or '?'!r})"


class Unreadable(ValueError):
    """A stored message that is not in the layout its label names."""


@dataclass(frozen=True)
class Prepared:
    """One event's message as stored: the text and its label."""

    message: str
    format: str


def prepare(
    task: Task[Any, Any],
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    headers: dict[str, Any],
    options: dict[str, Any],
    *,
    key: str = "",
) -> Prepared | None:
    """The message to store with one event of ``task`` (its row's columns, which stay
    as they are), or None where the relay must build it (module docstring). ``key``:
    the event's idempotency key, rendered by the writer's ``check_call`` from these
    arguments (not rendered again)."""
    writer = _Writer.of(task.app)
    if (
        writer is None
        or signals.before_task_publish.has_listeners(task.name)
        or signals.task_sent.receivers
    ):
        return None
    plan = Plan.of(task) if writer.batch.enabled else None
    # An ExplicitTask's message carries its send time (``stamp``), which the relay
    # splices in; a plain task's carries none, so the stored text would not fit it.
    if plan is None or not plan.explicit:
        return None
    # What the relay would send (CeleryMessages.send), on a copy: the row keeps its own.
    message, options, _ignore_result = writer.batch.build(
        plan,
        task_id,
        args,
        kwargs,
        {PUBLISHED_VIA_HEADER: "outbox", **headers},
        options,
        reply_to=task.app.thread_oid,
        key=key,
    )
    return envelope(message, options, **writer.settings)


class _Writer:
    """What building an app's messages reads at most once a second (``REFRESH``), not
    once an event: Celery's settings (through Django's, about 9 µs each) and its send
    path's (``celery_send.Batch``, about 70 µs). A change through ``app.conf`` is seen
    within a second, one through Django's settings (``override_settings``) at once."""

    REFRESH = 1.0
    _known: dict[int, tuple[Celery, float, _Writer | None]] = {}
    _lock = threading.Lock()

    def __init__(self, app: Celery) -> None:
        conf = app.conf
        self.batch = Batch(app)
        self.settings: dict[str, Any] = {
            "queues": app.amqp.queues,
            "default_queue": app.amqp.default_queue,
            "serializer": conf.task_serializer,
            "compression": conf.task_compression,
            "default_delivery_mode": conf.task_default_delivery_mode,
            "body_encoding": (conf.broker_transport_options or {}).get(
                "body_encoding", _BODY_ENCODING
            ),
        }

    @classmethod
    def of(cls, app: Celery) -> _Writer | None:
        """The app's writer; None unless its broker is Redis."""
        now = time.monotonic()
        known = cls._known.get(id(app))
        if known is not None and known[0] is app and now - known[1] < cls.REFRESH:
            return known[2]
        url = str(app.conf.broker_url or "")
        writer = cls(app) if url.startswith(REDIS_URL_SCHEMES) else None
        with cls._lock:
            cls._known[id(app)] = (app, now, writer)
        return writer

    @classmethod
    def forget(cls, **_kwargs: Any) -> None:
        """Read every app's settings again at the next write (``setting_changed``)."""
        with cls._lock:
            cls._known.clear()


setting_changed.connect(_Writer.forget, dispatch_uid="django_outbox.outbox.prepared")


def envelope(
    message: Any,
    options: dict[str, Any],
    *,
    queues: Any,
    default_queue: Any,
    serializer: str,
    compression: str | None,
    default_delivery_mode: Any,
    body_encoding: str,
) -> Prepared | None:
    """The stored form of the message kombu's Redis transport would push for ``message``
    (Celery's ``(headers, properties, body, sent_event)``) sent with ``options`` (what
    ``send_task_message`` takes: routed, ``celery_send.Batch.build``); None when that
    publish would do more than push these bytes to one list (module docstring)."""
    headers2, properties, body, _sent_event = message
    options = dict(options)
    headers = options.pop("headers", None) or {}
    exchange = options.pop("exchange", None)
    routing_key = options.pop("routing_key", None)
    queue = options.pop("queue", None)
    delivery_mode = options.pop("delivery_mode", None)
    exchange_type = options.pop("exchange_type", None)
    serializer = options.pop("serializer", None) or serializer
    compression = options.pop("compression", None) or compression
    for name in (
        "event_dispatcher",
        "retry",
        "retry_policy",
        "declare",
        "timeout",
        "confirm_timeout",
    ):
        if options.pop(name, None) not in (None, False, [], {}):
            return None  # a publish option the stored bytes cannot carry
    if compression or body_encoding != _BODY_ENCODING:
        return None
    # send_task_message: the caller's headers over Celery's, the rest as properties.
    headers = {**headers2, **headers}
    properties = {**properties, **options}
    if queue is None and exchange is None:
        queue = default_queue
    if isinstance(queue, str):
        queue = queues[queue]
    if queue is None:
        return None
    qname = queue.name
    if delivery_mode is None:
        delivery_mode = getattr(queue.exchange, "delivery_mode", None) or default_delivery_mode
    if exchange_type is None:
        exchange_type = getattr(queue.exchange, "type", "direct")
    # Celery sends a direct exchange's message to the queue by name (the anonymous
    # exchange); anything else is routed by the broker's bindings, which the stored
    # bytes cannot follow.
    if not ((not exchange or not routing_key) and exchange_type == "direct"):
        return None
    if queue.expires is not None or "x-expires" in (queue.queue_arguments or {}):
        return None
    if "\n" in qname:
        return None
    # kombu's Producer.publish and Channel.prepare_message.
    priority = properties.pop("priority", None)
    if priority:
        return None  # another list than the queue's own
    for name in ("mandatory", "immediate", "expiration", "content_type", "content_encoding"):
        if properties.pop(name, None) is not None:
            return None
    properties["delivery_mode"] = maybe_delivery_mode(delivery_mode)
    content_type, content_encoding, data = serialize(body, serializer=serializer)
    properties.setdefault("priority", 0)  # the channel's default_priority
    properties["delivery_info"] = {"exchange": "", "routing_key": qname}
    properties["body_encoding"] = body_encoding
    properties.pop("timestamp", None)  # the relay's, at the publish
    headers.pop(SENT_AT_HEADER, None)
    head = dumps(
        {
            "body": Base64().encode(data),
            "content-encoding": content_encoding,
            "content-type": content_type,
            "headers": headers,
        }
    )
    tail = dumps(properties)
    if not head.endswith("}}") or not tail.endswith("}") or not headers or not properties:
        return None
    return Prepared(f"{qname}\n{head[:-2]}\n{tail[:-1]}", format_label())


def splice(text: str, sent_at: float, delivery_tag: str) -> tuple[str, str]:
    """The Redis list and the bytes to push for a stored message, with this publish's
    send time and delivery tag; ``Unreadable`` if it is not three lines."""
    parts = text.split("\n")
    if len(parts) != 3 or not parts[0] or not parts[1].startswith("{") or not parts[2]:
        raise Unreadable(f"it is not in its format: {len(parts)} lines, not the 3 of {FORMAT}")
    key, head, properties = parts
    return key, (
        f'{head}, "{SENT_AT_HEADER}": {sent_at!r}}}, "properties": {properties}, '
        f'"timestamp": {int(sent_at)}, "delivery_tag": "{delivery_tag}"}}}}'
    )
