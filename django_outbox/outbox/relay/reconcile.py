"""Reconciliation: an event the relay published that no worker ever received is
published again, and dead-lettered (``not_received``) if that keeps happening.

**Why.** The relay marks an event published when the broker took the message. That is
not the same as a worker having it: kombu's Redis transport takes a message with
``BRPOP`` and records it in its ``unacked`` hash with a second command, so a broker
restart between the two keeps the pop and loses the message (measured in the chaos
suite, R2: about one job per five restarts of an append-only Redis; celery/kombu#305).
A queue deleted or purged by hand loses messages the same way. The outbox holds the
event, so the relay is the one place that can notice and publish it again.

**What counts as received.** Our own rows of the job, looked up by its task id (the
event id): a ledger entry, a dead letter or an attempt that ended it (PostgreSQL). Found:
the event is marked ``checked_at`` and never looked at again. An attempt that did not
end the job (a retry scheduled, a deferral while the database was down, a stale copy
fenced) says only that the job was received once: its next message can be lost as the
first one could. The job is followed until it ends: once the latest such attempt's next
message is ``EXPLICIT_OUTBOX_RECONCILE_AFTER`` overdue with no newer trace, the job is
published again (same task id, its retry count kept), as a lost first message is.
A live message lease record (``lease:<id>``, written while a Redis worker holds the
message) or a live execution lease (``run:<id>``, while a handler runs) means in
flight: looked at again later. Only ExplicitTask events are reconciled: a plain task
leaves none of these, so its silence means nothing.

**When.** An event is looked at ``EXPLICIT_OUTBOX_RECONCILE_AFTER`` seconds (default
300) after its publish, and only once its queue has moved past it: the queue is empty
or its oldest message was sent after the event was published. A queue with a backlog
older than the event still holds it, most likely, so nothing is published again while
the backlog lasts (a republish of every waiting job would double the backlog, the
storm this must not start). Where the oldest message's time cannot be read the queue
is taken to still hold it.

**What is published again.** The same message: same task id, arguments, headers and
options, so the consumer's idempotency key and dedup id absorb a copy whose original
turns up after all (a copy is the cost of being wrong; a lost job is the cost of not
looking). Each republish counts on the row (``republished``) and in a WARNING naming
the task, the event and its key. After ``EXPLICIT_OUTBOX_RECONCILE_LIMIT`` (default 3)
republishes without a trace, the event becomes a dead letter (``not_received``): the
loss repeats, and an operator should see it. An event with an ordering key is
dead-lettered at once instead of published again: published now it would take a new
number after its entity's later events, and be applied after them.

**Cost.** One pass every ``RECONCILE_AFTER / 4`` seconds (at least 1 s), on one relay
at a time (the rows are claimed ``FOR UPDATE SKIP LOCKED``): a range scan of a partial
index holding only unchecked published events, three ``task_id IN (...)`` lookups, two
``EXISTS`` per event without a trace, and a queue look per queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery import Celery
from django.db import connections, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone
from prometheus_client import Counter

from celery_explicit import execution_lease, job_log, message_lease, redis_state
from celery_explicit.errors import qualname
from celery_explicit.headers import KEY_HEADER, PUBLISHED_VIA_HEADER
from django_outbox import broker_queues
from django_outbox.conf import settings
from django_outbox.models import (
    DeadLetterReason,
    OutboxEvent,
    OutboxStatus,
)
from django_outbox.outbox.relay import traces
from django_outbox.outbox.relay.publish import dead_letter_event, log_fields
from django_outbox.outbox.relay.traces import Unended

__all__ = ["Reconciler", "Reconciled"]

logger = job_log.get_logger("django_outbox.outbox.relay.reconcile")

republished_total = Counter(
    "explicit_outbox_republished_total",
    "Outbox events published again: no worker had received them",
    ["task"],
)
not_received_total = Counter(
    "explicit_outbox_not_received_total",
    "Outbox events dead-lettered: published repeatedly, never received",
    ["task"],
)

#: Events looked at in one pass, and rows past the horizon aged out in one pass.
BATCH = 500


@dataclass
class Reconciled:
    """What one pass did."""

    looked_at: int = 0
    received: int = 0
    #: Received, not ended, and its next message not overdue yet.
    retrying: int = 0
    in_flight: int = 0
    #: Their queue still held messages older than them.
    queued: int = 0
    republished: int = 0
    dead_lettered: int = 0
    aged_out: int = 0
    #: The broker failed mid-pass: the rest waits for the next pass.
    broker_error: BaseException | None = None
    ids: list[str] = field(default_factory=list)


@dataclass
class Reconciler:
    """Looks for published events no worker received; one per relay."""

    app: Celery
    using: str
    after: float
    limit: int
    horizon: float
    _next: float = 0.0

    @classmethod
    def from_settings(cls, app: Celery, using: str) -> Reconciler:
        return cls(
            app=app,
            using=using,
            after=settings.outbox_reconcile_after,
            limit=settings.outbox_reconcile_limit,
            horizon=settings.outbox_reconcile_horizon,
        )

    @property
    def enabled(self) -> bool:
        return self.after > 0

    def due(self) -> bool:
        """True once per interval (``after / 4``, at least 1 s) while enabled."""
        if not self.enabled:
            return False
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + max(1.0, self.after / 4)
        return True

    def run_once(self) -> Reconciled:
        """One pass: claim due events, check each, republish or dead-letter the lost."""
        done = Reconciled()
        with transaction.atomic(using=self.using):
            done.aged_out = self._age_out()
            events = list(
                OutboxEvent.objects.using(self.using)
                .select_for_update(skip_locked=_skip_locked(self.using))
                .filter(
                    status=OutboxStatus.PUBLISHED,
                    checked_at__isnull=True,
                    published_at__lte=Now() - timedelta(seconds=self.after),
                )
                .order_by("published_at")[:BATCH]
            )
            done.looked_at = len(events)
            if not events:
                return done
            ended, unended = traces.of({str(e.event_id) for e in events}, using=self.using)
            seen = [e.id for e in events if str(e.event_id) in ended]
            done.received = len(seen)
            if seen:
                OutboxEvent.objects.using(self.using).filter(id__in=seen).update(checked_at=Now())
            lost: list[tuple[OutboxEvent, Unended | None]] = []
            overdue_before = time.time() - self.after
            for event in events:
                task_id = str(event.event_id)
                if task_id in ended:
                    continue
                latest = unended.get(task_id)
                if latest is not None and latest.next_due > overdue_before:
                    done.retrying += 1  # its next message is not overdue yet
                    continue
                lost.append((event, latest))
            try:
                self._settle(lost, done)
            except self._broker_errors() as exc:
                done.broker_error = exc
                logger.warning(
                    "outbox reconcile: broker unavailable (%s: %s); next pass tries again",
                    qualname(exc),
                    exc,
                    extra={"layer": "delivery", "error_class": qualname(exc)},
                )
        return done

    # --- the checks --------------------------------------------------------------

    def _in_flight(self, task_id: str, broker_client: Any) -> bool:
        """A worker holds the message or runs the job now (its leases are live)."""
        if redis_state.client().exists(execution_lease.lease_key(task_id)):
            return True
        return bool(
            broker_client is not None and broker_client.exists(message_lease.record_key(task_id))
        )

    def _settle(self, lost: list[tuple[OutboxEvent, Unended | None]], done: Reconciled) -> None:
        if not lost:
            return
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            broker_client = _redis_client(conn)
            heads: dict[str, tuple[int, float | None]] = {}
            producer = conn.Producer(auto_declare=True)
            for event, latest in lost:
                task = self.app.tasks.get(event.task_name)
                if message_lease.contract_of(task) is None:
                    # Not an ExplicitTask (or gone since): it leaves no trace to find.
                    OutboxEvent.objects.using(self.using).filter(id=event.id).update(
                        checked_at=Now()
                    )
                    continue
                task_id = str(event.event_id)
                if self._in_flight(task_id, broker_client):
                    done.in_flight += 1
                    continue
                queue = self._queue_of(task, event)
                if queue not in heads:
                    heads[queue] = _queue_head(conn, queue)
                # The message to look past: the first publish, or the latest attempt's
                # next one (published when that attempt ended).
                sent = latest.sent if latest else _timestamp(event.published_at)
                if not _queue_is_past(heads[queue], sent):
                    done.queued += 1
                    continue
                if event.ordering_key or event.republished >= self.limit:
                    self._dead_letter(event)
                    done.dead_lettered += 1
                else:
                    self._republish(task, event, producer, latest)
                    done.republished += 1
                done.ids.append(task_id)

    def _queue_of(self, task: Any, event: OutboxEvent) -> str:
        queue = event.options.get("queue") if isinstance(event.options, dict) else None
        if queue:
            return str(getattr(queue, "name", queue))
        try:
            routed = self.app.amqp.router.route({}, event.task_name, (), {})
            return str(routed["queue"].name)
        except Exception:  # a router that needs arguments: Celery's default queue
            return str(getattr(task, "queue", None) or self.app.conf.task_default_queue)

    # --- the two outcomes ----------------------------------------------------------

    def _republish(
        self, task: Any, event: OutboxEvent, producer: Any, latest: Unended | None = None
    ) -> None:
        headers = dict(event.headers) if isinstance(event.headers, dict) else {}
        options = dict(event.options) if isinstance(event.options, dict) else {}
        if latest is not None:
            # The lost message was the retry after attempt N: it carried N retries.
            options["retries"] = latest.attempt
        task.apply_async(
            tuple(event.args),
            event.kwargs,
            task_id=str(event.event_id),
            producer=producer,
            headers={PUBLISHED_VIA_HEADER: "outbox", **headers},
            retry=False,
            **options,
        )
        assert event.published_at is not None
        if latest is not None:
            waited = time.time() - latest.next_due
            what = f"its retry after attempt {latest.attempt} was {waited:.0f}s overdue"
        else:
            waited = (timezone.now() - event.published_at).total_seconds()
            what = f"no worker had received it {waited:.0f}s after its publish"
        OutboxEvent.objects.using(self.using).filter(id=event.id).update(
            republished=F("republished") + 1,
            published_at=Now(),
            last_error=f"published again: {what}",
        )
        republished_total.labels(event.task_name).inc()
        logger.warning(
            "outbox event %s (%s, key %s) published again: %s (republish %d of %d)",
            event.event_id,
            event.task_name,
            headers.get(KEY_HEADER, ""),
            what,
            event.republished + 1,
            self.limit,
            extra=log_fields(event, republished=event.republished + 1),
        )

    def _dead_letter(self, event: OutboxEvent) -> None:
        if event.ordering_key:
            why = (
                f"published, never received by a worker; it has ordering key "
                f"{event.ordering_key!r}, and published again now it would be applied "
                "after its entity's later events: replay it deliberately"
            )
        else:
            why = (
                f"published {event.republished + 1} times, never received by a worker "
                f"(EXPLICIT_OUTBOX_RECONCILE_LIMIT is {self.limit})"
            )
        dead_letter_event(
            event,
            DeadLetterReason.NOT_RECEIVED,
            using=self.using,
            error_class="django_outbox.outbox.relay.reconcile.NotReceived",
            message=why,
            attempts=event.republished + 1,
            columns={"published_at": None},
        )
        not_received_total.labels(event.task_name).inc()
        logger.error(
            "outbox event %s dead-lettered (not_received): %s",
            event.event_id,
            why,
            extra=log_fields(event, reason=DeadLetterReason.NOT_RECEIVED.value),
        )

    def _age_out(self) -> int:
        """Mark checked (without a look) a batch of events past the horizon: their
        attempt rows may be pruned, and they would stay in the partial index."""
        old = OutboxEvent.objects.using(self.using).filter(
            status=OutboxStatus.PUBLISHED,
            checked_at__isnull=True,
            published_at__lt=Now() - timedelta(seconds=self.horizon),
        )
        ids = list(old.order_by("published_at").values_list("id", flat=True)[:BATCH])
        if not ids:
            return 0
        return int(
            OutboxEvent.objects.using(self.using).filter(id__in=ids).update(checked_at=Now())
        )

    def _broker_errors(self) -> tuple[type[BaseException], ...]:
        """What a broker outage raises (kombu's connection errors, Redis's, OS errors)."""
        import redis

        conn = self.app.connection_for_write()  # not connected: only its error classes
        return (
            *conn.connection_errors,
            *conn.channel_errors,
            redis.ConnectionError,
            redis.TimeoutError,
            OSError,
        )


def _queue_head(conn: Any, queue: str) -> tuple[int, float | None]:
    """The queue's depth and when its oldest message was sent (None: unreadable)."""
    state = broker_queues.queue_state(conn, queue)
    if state.depth == 0 or state.oldest_age is None:
        return state.depth, None
    return state.depth, time.time() - state.oldest_age


def _queue_is_past(head: tuple[int, float | None], sent: float | None) -> bool:
    """The queue is empty, or its oldest message was sent after ``sent`` (epoch s).
    Unreadable: taken to still hold it."""
    depth, oldest_sent = head
    if depth == 0:
        return True
    if oldest_sent is None or sent is None:
        return False
    return oldest_sent > sent


def _timestamp(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def _skip_locked(using: str) -> bool:
    return bool(connections[using].features.has_select_for_update_skip_locked)


def _redis_client(conn: Any) -> Any:
    """The broker's Redis client (the message lease records live there), else None."""
    if conn.transport.driver_type != "redis":
        return None
    return conn.default_channel.client
