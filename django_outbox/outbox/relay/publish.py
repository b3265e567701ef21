"""What becomes of one claimed outbox event: published, deduplicated, dead-lettered, or
backed off. The relay's publish policy; ``django_outbox.outbox.relay.loop`` runs the batches.

One event failing by itself never stops the relay: bad input and unknown tasks go to
the dead letters at once; other errors are recorded on the row (``attempts``,
``last_error``) and retried after a backoff of its own, until
``EXPLICIT_OUTBOX_MAX_ATTEMPTS``, then dead-lettered (``exhausted``) so the event stops
holding back its ordering key. A broker outage is not the event's fault: it is raised
to the relay, which backs the whole batch off.

**Confirmed, or not published.** With publisher confirms (RabbitMQ's
``confirm_publish``, check W014) a publish returns once the broker has the message,
so an event is marked published only then. A message the broker refuses (a
``basic.nack``: a queue at its length limit with ``overflow: reject-publish``, say)
is this event's failure, not an outage: kombu raises it as its ``OperationalError``,
and the relay would otherwise back the whole outbox off for one full queue.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import Celery, Task, signals
from celery.exceptions import QueueNotFound
from django.db.models import F
from django.db.models.functions import Now
from kombu.serialization import loads as deserialize
from kombu.transport.virtual.base import Base64

from celery_explicit import job_log, tracing
from celery_explicit.errors import BadInput, qualname
from celery_explicit.headers import (
    CORRELATION_HEADER,
    KEY_HEADER,
    PUBLISHED_VIA_HEADER,
)
from celery_explicit.metrics import dead_letters as dead_letters_total
from celery_explicit.retry_policy import backoff_delay
from celery_explicit.versions import __version__
from django_outbox.models import DeadLetterReason, OutboxEvent, OutboxStatus
from django_outbox.outbox import prepared
from django_outbox.outbox.relay import celery_send
from django_outbox.outbox.relay.broker import BrokerConnection
from django_outbox.outbox.relay.claim import Claimed
from django_outbox.outbox.relay.metrics import dead_lettered, publish_failed
from django_outbox.store import dead_letters

__all__ = ["CeleryMessages", "PublishPolicy", "dead_letter_event", "log_fields"]

logger = job_log.get_logger("django_outbox.outbox.relay.loop")


@dataclass(frozen=True)
class PublishPolicy:
    """Publishes one event through its task and records what became of it, in the
    batch's transaction on ``using``."""

    app: Celery
    using: str
    broker: BrokerConnection
    max_attempts: int
    backoff_base: float
    backoff_cap: float
    rng: random.Random

    def messages(self, producer: Any) -> CeleryMessages:
        """The sender of one batch's messages through ``producer``."""
        return CeleryMessages(self.app, producer)

    def publish(self, event: Claimed, messages: CeleryMessages) -> OutboxStatus | None:
        """Publish one event; returns its new status, None if it stays pending."""
        # A prepared message is pushed as stored, its columns unread (``Claimed.call``):
        # they are parsed and checked only when the message is built from them.
        if not event.message and event.call.malformed:
            return self.refuse_malformed(event)
        task: Task[Any, Any] | None = messages.task(event.task_name)
        if task is None:
            self.dead_letter(
                event,
                DeadLetterReason.UNKNOWN_TASK,
                error_class="celery.exceptions.NotRegistered",
                message=f"outbox event names task {event.task_name!r}, which is not "
                "registered in the relay: not published",
            )
            return OutboxStatus.DEAD_LETTER
        event_id = event.event_id
        if event.message:
            outcome = self.publish_prepared(event, task, messages)
            if outcome is not None:
                return outcome
            if event.call.malformed:
                return self.refuse_malformed(event)
        call = event.call
        try:
            # A span continuing the row's stored trace; its context replaces the stored one.
            with (
                tracing.relay_publish(event.task_name, str(event_id), call.headers)
                if messages.traced
                else nullcontext(call.headers)
            ) as headers:
                sent = messages.send(
                    task,
                    event_id,
                    tuple(call.args),
                    call.kwargs,
                    {PUBLISHED_VIA_HEADER: "outbox", **headers},
                    call.options,
                )
        except BadInput as exc:
            self.dead_letter(
                event, DeadLetterReason.BAD_INPUT, error_class=qualname(exc), message=str(exc)
            )
            return OutboxStatus.DEAD_LETTER
        except QueueNotFound as exc:
            # A KeyError, which kombu's Redis transport counts among its connection
            # errors: caught first, or one event naming a removed queue would look like
            # a broker outage and hold the whole outbox back forever.
            return self.fail(event, exc)
        except self.broker.errors() as exc:
            refused = _refusal(exc)
            if refused is None:
                raise
            return self.fail(event, refused, spend=False)
        except Exception as exc:
            # Anything else this one event raises is its own problem: it must not stop
            # the events after it.
            return self.fail(event, exc)
        # An ExplicitTask with a dedup_key publishes nothing when another message
        # owns the id, and hands back that message's id instead.
        if sent is not None and getattr(sent, "id", event_id) != event_id:
            return OutboxStatus.DEDUPLICATED
        return OutboxStatus.PUBLISHED

    def refuse_malformed(self, event: Claimed) -> OutboxStatus:
        """Dead-letter an event whose columns do not have the shapes the relay writes."""
        self.dead_letter(
            event,
            DeadLetterReason.BAD_INPUT,
            error_class="django_outbox.outbox.relay.loop.MalformedEvent",
            message=f"outbox event columns have the wrong shape: {event.malformed}",
        )
        return OutboxStatus.DEAD_LETTER

    def publish_prepared(
        self, event: Claimed, task: Task[Any, Any], messages: CeleryMessages
    ) -> OutboxStatus | None:
        """Push an event's prepared message (``django_outbox.outbox.prepared``): its
        status, or None when this batch builds the message instead (it needs it built:
        a span, a ``before_task_publish`` receiver). A layout this version does not
        read, or text not in the layout its label names, is a ``bad_input`` dead
        letter naming the version that wrote it: never published half-read."""
        label = event.message_format
        try:
            if not prepared.readable(label):
                raise prepared.Unreadable(
                    f"this relay (celery-explicit {__version__}) reads {prepared.FORMAT} only"
                )
            if not messages.takes_prepared(task):
                return None
            messages.push(event, task)
        except prepared.Unreadable as exc:
            self.dead_letter(
                event,
                DeadLetterReason.BAD_INPUT,
                error_class=qualname(exc),
                message=f"outbox event's prepared message was written by "
                f"{prepared.version_of(label)}, and {exc}: not published (its arguments "
                "stay on the row)",
            )
            return OutboxStatus.DEAD_LETTER
        return OutboxStatus.PUBLISHED

    def fail(self, event: Claimed, exc: Exception, *, spend: bool = True) -> OutboxStatus | None:
        """Back the event off, or dead-letter it past its attempts.

        ``spend=False`` (the broker refused the message: a full queue pushing back)
        waits a capped, jittered backoff without spending an attempt: backpressure that
        lasts is waited out, as an outage is, never turned into a dead letter."""
        attempts = event.attempts + 1 if spend else event.attempts
        error_class = qualname(exc)
        message = f"{error_class}: {exc}"
        publish_failed.labels(event.task_name, error_class).inc()
        if spend and attempts >= self.max_attempts:
            self.dead_letter(
                event,
                DeadLetterReason.EXHAUSTED,
                error_class=error_class,
                message=f"outbox event failed to publish {attempts} times: {message}",
            )
            return OutboxStatus.DEAD_LETTER
        delay = backoff_delay(
            attempts if spend else self.max_attempts,
            base=self.backoff_base,
            cap=self.backoff_cap,
            rng=self.rng,
        )
        OutboxEvent.objects.using(self.using).filter(id=event.id).update(
            attempts=F("attempts") + (1 if spend else 0),
            last_error=message[:4000],
            available_at=Now() + timedelta(seconds=delay),
        )
        logger.warning(
            "outbox event %s (%s) failed to publish, attempt %d; next try in %.1fs: %s"
            + ("" if spend else " (not counted against EXPLICIT_OUTBOX_MAX_ATTEMPTS)"),
            event.event_id,
            event.task_name,
            attempts,
            delay,
            message,
            extra=log_fields(event, error_class=error_class, attempt=attempts),
        )
        return None

    def dead_letter(
        self, event: Claimed, reason: DeadLetterReason, *, error_class: str, message: str
    ) -> None:
        """Record the dead letter and close the event, in the batch's transaction."""
        dead_letter_event(
            event,
            reason,
            using=self.using,
            error_class=error_class,
            message=message,
            attempts=event.attempts + 1,
            columns={"attempts": F("attempts") + 1},
        )
        dead_lettered.labels(event.task_name, reason.value).inc()
        logger.error(
            "outbox event %s dead-lettered (%s): %s",
            event.event_id,
            reason.value,
            message,
            extra=log_fields(event, error_class=error_class, reason=reason.value),
        )


def dead_letter_event(
    event: Claimed | OutboxEvent,
    reason: DeadLetterReason,
    *,
    using: str,
    error_class: str,
    message: str,
    attempts: int,
    columns: Mapping[str, Any] | None = None,
) -> None:
    """Record the dead letter of an outbox event and close its row (status
    ``dead_letter``, ``last_error``, and ``columns``), in the caller's transaction on
    ``using``; counted in ``explicit_dead_letters_total``. The relay and the reconciler
    each count and log their own reason."""
    headers = _headers(event)
    dead_letters.record(
        task_id=str(event.event_id),
        task_name=event.task_name,
        reason=reason,
        args=event.args,
        kwargs=event.kwargs,
        idempotency_key=str(headers.get(KEY_HEADER) or ""),
        error_class=error_class,
        error_message=message,
        attempts=attempts,
        correlation_id=str(headers.get(CORRELATION_HEADER) or ""),
        queue=str((event.options or {}).get("queue") or ""),
    )
    OutboxEvent.objects.using(using).filter(id=event.id).update(
        status=OutboxStatus.DEAD_LETTER, last_error=message[:4000], **(columns or {})
    )
    dead_letters_total.labels(event.task_name, reason.value).inc()


class BrokerRefused(Exception):
    """The broker answered a publish with a ``basic.nack``: it is up, and did not take
    this message."""


def _refusal(exc: BaseException) -> BrokerRefused | None:
    """The broker's refusal behind ``exc`` (py-amqp's ``MessageNacked``, which kombu
    re-raises as an ``OperationalError``), or None for anything else."""
    from amqp.exceptions import MessageNacked

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MessageNacked):
            return BrokerRefused(
                "the broker refused the message (basic.nack): a queue at its length "
                "limit with overflow reject-publish, or a broker-side error"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def log_fields(event: Claimed | OutboxEvent, **more: Any) -> dict[str, Any]:
    """The fields of a log line about an outbox event; ``more`` added last."""
    return {
        "task": event.task_name,
        "job_id": str(event.event_id),
        "idempotency_key": str(_headers(event).get(KEY_HEADER) or ""),
        "ordering_key": event.ordering_key,
        "layer": "delivery",
        **more,
    }


def _headers(event: Claimed | OutboxEvent) -> dict[str, Any]:
    # A claimed row's are a dict (a malformed column is replaced by an empty one); a
    # model row's are what the column holds.
    return event.headers if isinstance(event.headers, dict) else {}


# --- the Celery message ------------------------------------------------------------


class CeleryMessages:
    """One batch's sender of Celery messages through one producer.

    Each event's message carries our headers, stamped by the function
    ``ExplicitTask.apply_async`` stamps them with (``celery_explicit.headers.stamp``),
    and goes through Celery's send path: the batch's own copy of it where
    ``celery_send.Plan`` allows (twice as fast), else ``task.apply_async``. Either way
    Celery's ``before_task_publish`` and ``after_task_publish`` signals fire for it, as
    for any message ``apply_async`` sends (tests/unit/test_message_headers.py)."""

    def __init__(self, app: Celery, producer: Any) -> None:
        self.producer = producer
        self.tasks = app.tasks
        # Off: no span per event (checking costs as much as the rest of the headers).
        self.traced = tracing.enabled()
        self.celery = celery_send.Batch(app, producer)
        # Prepared messages (django_outbox.outbox.prepared) go out on the broker's
        # Redis only, by their own pipeline, and only where nothing here needs the
        # message built: no span, no before_task_publish receiver.
        self.prepared_ok = (
            self.celery.enabled
            and not self.traced
            and getattr(producer.connection.transport, "driver_type", "") == "redis"
        )
        self._takes: dict[str, bool] = {}
        #: (list, bytes, event, task) of the prepared messages not pushed yet.
        self.unpushed: list[tuple[str, str, Claimed, Task[Any, Any]]] = []

    def task(self, name: str) -> Task[Any, Any] | None:
        """The registered task of that name, None if the relay knows none."""
        task: Task[Any, Any] | None = self.tasks.get(name)
        return task

    def send(
        self,
        task: Task[Any, Any],
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        headers: dict[str, Any],
        options: dict[str, Any],
    ) -> Any:
        """Publish one event's message; returns what ``task.apply_async`` returned, or
        None when the batch's own send path sent it."""
        plan = self.celery.plan(task)
        if plan is None:
            return task.apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=self.producer,
                headers=headers,
                # Fail fast: the relay's own backoff replaces Celery's publish retries,
                # which would hold the whole batch (and its row locks) meanwhile.
                retry=False,
                **options,
            )
        self.celery.send_task(plan, task_id, args, kwargs, headers, options)
        return None

    def takes_prepared(self, task: Task[Any, Any]) -> bool:
        """Whether this batch pushes a prepared message of ``task`` as stored."""
        name = task.name
        takes = self._takes.get(name)
        if takes is None:
            takes = self._takes[name] = (
                self.prepared_ok
                and self.celery.plan(task) is not None
                and not signals.before_task_publish.has_listeners(name)
                and not signals.task_sent.receivers
            )
        return takes

    def push(self, event: Claimed, task: Task[Any, Any]) -> None:
        """Add an event's prepared message, with this publish's send time and delivery
        tag, to the batch's pipeline (sent by ``flush``); ``prepared.Unreadable`` if it
        is not in its format."""
        key, payload = prepared.splice(event.message, time.time(), str(uuid.uuid4()))
        self.unpushed.append((key, payload, event, task))

    def flush(self) -> None:
        """Push the prepared messages in one pipeline on the producer's channel (its
        Redis connection, key prefix and all), then fire ``after_task_publish`` for
        each. Raised as a broker error if the pipeline fails: none of them counts as
        published then (``unpushed`` keeps them)."""
        if not self.unpushed:
            return
        channel = self.producer.channel
        with (
            self.producer.connection._reraise_as_library_errors(),
            channel.conn_or_acquire() as client,
        ):
            pipe = client.pipeline(transaction=False)
            for key, payload, _event, _task in self.unpushed:
                pipe.lpush(key, payload)
            pipe.execute()
        pushed, self.unpushed = self.unpushed, []
        for _key, _payload, event, task in pushed:
            if not task.ignore_result:
                task.backend.on_task_call(self.producer, event.event_id)
        if signals.after_task_publish.receivers:
            for _key, payload, _event, task in pushed:
                _after_publish(task.name, payload)


def _after_publish(name: str, payload: str) -> None:
    """``after_task_publish`` for one pushed message, with what Celery's send passes."""
    message = json.loads(payload)
    body = deserialize(
        Base64().decode(message["body"]),
        message["content-type"],
        message["content-encoding"],
        accept={message["content-type"]},
    )
    signals.after_task_publish.send(
        sender=name,
        body=tuple(body),  # Celery's (args, kwargs, embed), as send_task_message passes it
        headers=message["headers"],
        exchange=message["properties"]["delivery_info"]["exchange"],
        routing_key=message["properties"]["delivery_info"]["routing_key"],
    )
