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
message), a live execution lease (``run:<id>``, while a handler runs) or a live
deferral marker (``deferred:<id>``: a deferral writes no attempt row, so it leaves this
until ``RECONCILE_AFTER`` after its next message is due, ``celery_explicit.republish``)
means in flight: looked at again later. Only ExplicitTask events are reconciled: a
plain task leaves none of these, so its silence means nothing.

**When.** An event is looked at ``EXPLICIT_OUTBOX_RECONCILE_AFTER`` seconds (default
300) after its publish, and only once its queue has moved past it: the queue is empty
or its oldest message was sent after the event was published. A queue with a backlog
older than the event still holds it, most likely, so nothing is published again while
the backlog lasts (a republish of every waiting job would double the backlog, the
storm this must not start). Where the oldest message's time cannot be read the queue
is taken to still hold it.

A worker holds messages the queue no longer counts: prefetched for a free process, or
held until its ETA (a retry's countdown, a deferral's) by a classic queue's consumer.
On Redis each of them has its lease record (``lease:<id>``, above): the exact answer
for that one job. RabbitMQ keeps no record of a held message that reconciliation can
read, and the passive declare counts ready messages only: a queue of 0 can have the
job waiting in a worker, alive. So on a broker without per-message records the queue
counts as past the event only when, in the management API's figures as well, nothing
in it is unacknowledged (``messages_unacknowledged``) and, if the declare finds it
empty, nothing was ready (those figures are a few seconds older than the declare: a
message delivered in between is in neither count); figures that cannot be read count
as "may still hold it". The price: a message lost on a queue its workers never leave
idle waits for a quiet moment (RabbitMQ loses a confirmed message to a queue deleted or
purged, rarely otherwise). On Redis the unacknowledged count is not looked at: it is
never 0 on a busy queue, and would hold back the republish of a message lost in a
restart (R2, the loss this exists for) for as long as the load lasts.

**One clock.** What a pass compares it compares on PostgreSQL's clock where the choice
is ours: an event's publish (``published_at``, the database's statement time when the
relay marked it) and the pass's "now", the relay's clock plus its offset from
PostgreSQL's, measured once a pass (``clock_timestamp()``, against the midpoint of the
query's round trip): the relay's own clock drops out. Two times are not ours: a
queue's oldest message was stamped by its sender (its ``explicit_sent_at`` header on
Redis, its AMQP ``timestamp`` on RabbitMQ, in whole seconds rounded down) on that
host's clock, and an attempt's end and its next message's due time by its worker, on
the worker's clock (which also stamped that retry's message: a retry's head is
compared on one clock). What remains is those hosts' skew from PostgreSQL,
milliseconds under NTP. The head counts as sent after the event only ``CLOCK_MARGIN``
(1 s) later than it: that covers the skew, and the moment between an attempt's row and
its retry's publish, and costs nothing, since an event is looked at ``RECONCILE_AFTER``
after its publish, when a queue that moves at all is far past it. (A deferral marker
expires on the state store's clock, which no other time is compared with.)

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
index holding only unchecked published events, three ``task_id IN (...)`` lookups, one
clock reading, per event without a trace an ``EXISTS`` of two keys on the state store
(and one on a Redis broker), and a queue look per queue (on RabbitMQ a passive declare
and one management API request).
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
from prometheus_client import Counter

from celery_explicit import execution_lease, job_log, message_lease, redis_state, republish
from celery_explicit.errors import qualname
from celery_explicit.headers import FENCE_FREE_LEASE_HEADER, KEY_HEADER, PUBLISHED_VIA_HEADER
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

#: Seconds by which a queue's oldest message must have been sent after the event for
#: the queue to count as past it: its sender's clock against PostgreSQL's (module
#: docstring, "One clock").
CLOCK_MARGIN = 1.0

# DATABASE_NOW - PostgreSQL's clock now (epoch seconds); now() would be the
# transaction's start, which the pass's own statements have already moved past
DATABASE_NOW = "SELECT extract(epoch FROM clock_timestamp())"


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


@dataclass(frozen=True)
class Clock:
    """PostgreSQL's clock as a pass reads it: the relay's clock plus ``offset``."""

    offset: float = 0.0

    def now(self) -> float:
        return time.time() + self.offset


@dataclass(frozen=True)
class Head:
    """What a pass reads of a queue (``broker_queues.QueueState``)."""

    #: Messages waiting in it now.
    depth: int
    #: When its oldest message was sent (epoch s, its sender's clock); None: unreadable.
    oldest_sent: float | None
    #: Delivered to a worker, not acknowledged; None: unreadable.
    unacked: int | None
    #: RabbitMQ: waiting at the management API's last figures (as old as ``unacked``).
    reported_ready: int | None = None


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
            clock = _database_clock(self.using)
            overdue_before = clock.now() - self.after
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
                self._settle(lost, done, clock)
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
        """A worker holds the message or runs the job now (its leases are live), or a
        deferral of it has published its next message (its marker is live)."""
        # One EXISTS: both keys carry the task id's hash tag (one slot on a cluster).
        head = redis_state.prefix()
        keys = (
            execution_lease.lease_key(task_id, prefix=head),
            republish.deferral_key(task_id, prefix=head),
        )
        if redis_state.client().exists(*keys):
            return True
        return bool(
            broker_client is not None and broker_client.exists(message_lease.record_key(task_id))
        )

    def _settle(
        self, lost: list[tuple[OutboxEvent, Unended | None]], done: Reconciled, clock: Clock
    ) -> None:
        if not lost:
            return
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            broker_client = _redis_client(conn)
            heads: dict[str, Head] = {}
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
                    heads[queue] = _head(broker_queues.queue_state(conn, queue))
                    if broker_client is None and heads[queue].unacked is None:
                        _unread_once(queue)
                # The message to look past: the first publish, or the latest attempt's
                # next one (published when that attempt ended).
                sent = latest.sent if latest else _timestamp(event.published_at)
                if not _queue_is_past(heads[queue], sent, records=broker_client is not None):
                    done.queued += 1
                    continue
                if event.ordering_key or event.republished >= self.limit:
                    self._dead_letter(event)
                    done.dead_lettered += 1
                else:
                    self._republish(task, event, producer, clock, latest)
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
        self,
        task: Any,
        event: OutboxEvent,
        producer: Any,
        clock: Clock,
        latest: Unended | None = None,
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
            # An earlier execution may still run, its lease's record lost: this copy
            # fences it if it finds the lease free (celery_explicit.execution_lease_step).
            headers={PUBLISHED_VIA_HEADER: "outbox", **headers, FENCE_FREE_LEASE_HEADER: True},
            retry=False,
            **options,
        )
        assert event.published_at is not None
        if latest is not None:
            waited = clock.now() - latest.next_due
            what = f"its retry after attempt {latest.attempt} was {waited:.0f}s overdue"
        else:
            waited = clock.now() - event.published_at.timestamp()
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


def _database_clock(using: str) -> Clock:
    """PostgreSQL's clock, read once: its time against the midpoint of the query's
    round trip on the relay's clock. Another database (SQLite) is a file on the relay's
    host: its clock is the relay's."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return Clock()
    before = time.time()
    with connection.cursor() as cursor:
        cursor.execute(DATABASE_NOW)
        (database_now,) = cursor.fetchone()
    return Clock(float(database_now) - (before + time.time()) / 2)


def _head(state: broker_queues.QueueState) -> Head:
    """The queue as a pass compares it. The oldest message's sending time is its
    sender's stamp: ``oldest_age`` was measured against the relay's clock a moment ago,
    and adding that clock back cancels it (a stamp ahead of the relay's clock reads as
    now, which is past any event a pass looks at)."""
    if state.depth == 0 or state.oldest_age is None:
        return Head(state.depth, None, state.unacked, state.reported_ready)
    return Head(state.depth, time.time() - state.oldest_age, state.unacked, state.reported_ready)


def _workers_may_hold(head: Head) -> bool:
    """On a broker without per-message records (RabbitMQ): a worker may hold the job's
    message, alive. The management API's figures say it: a message unacknowledged, or
    one ready while the (newer) declare finds none, delivered since.

    Unread (the API off, unreachable, or not sent the broker's credentials over plain
    http to another host): the queue alone decides, as without the API, and a WARNING
    says so once per queue. Holding every event back instead would stop recovering
    lost jobs altogether, with nothing to show for it."""
    if head.unacked is None:
        return False
    return head.unacked != 0 or (head.depth == 0 and head.reported_ready not in (0, None))


_warned_unread: set[str] = set()


def _unread_once(queue: str) -> None:
    if queue in _warned_unread:
        return
    _warned_unread.add(queue)
    logger.warning(
        "outbox reconcile: queue %s's unacknowledged messages cannot be read (RabbitMQ's "
        "management API: EXPLICIT_RABBITMQ_MANAGEMENT_URL); a job a worker has prefetched "
        "but not started may be published again (its key absorbs the copy; an ordered "
        "event is dead-lettered not_received)",
        queue,
        extra={"layer": "delivery"},
    )


def _queue_is_past(head: Head, sent: float | None, *, records: bool) -> bool:
    """The queue has moved past a message sent at ``sent`` (epoch s): it is empty, or
    its oldest message was sent ``CLOCK_MARGIN`` after it; and, where the broker keeps
    no per-message ``records``, no worker holds any of its messages. Unreadable: taken
    to still hold it."""
    if not records and _workers_may_hold(head):
        return False
    if head.depth == 0:
        return True
    if head.oldest_sent is None or sent is None:
        return False
    return head.oldest_sent > sent + CLOCK_MARGIN


def _timestamp(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def _skip_locked(using: str) -> bool:
    return bool(connections[using].features.has_select_for_update_skip_locked)


def _redis_client(conn: Any) -> Any:
    """The broker's Redis client (the message lease records live there), else None."""
    if conn.transport.driver_type != "redis":
        return None
    return conn.default_channel.client
