"""The outbox relay: publishes committed outbox events, at least once, in order per key.

``manage.py outbox_relay`` runs ``Relay.run()``: claim a batch of pending events,
publish each through its Celery task with the event id as the task id, mark them, and
commit; then look again, or wait for a NOTIFY (PostgreSQL) or the poll interval.

**At least once.** The claim and the marks are one transaction, and the messages are
sent before it commits. A relay that dies mid-batch leaves its events pending: another
relay (or itself, restarted) publishes them again. The consumer's idempotency key
absorbs the duplicate; the relay cannot tell a republish from a first publish (the
transaction that died left no trace), the consumer can: a second attempt with the
same job id, ``already_applied``.

**Several relays, no double publish.** The claim locks its rows with ``FOR UPDATE
SKIP LOCKED``: a second relay skips rows another holds instead of waiting for them or
publishing them too. It sits in a ``MATERIALIZED`` CTE so the ``LIMIT`` is applied
before the lock: inlined, the planner may lock more rows than it returns.

**Order per key.** An event with an ``ordering_key`` is claimed only while no older
event with that key is pending, so at most one event per key is in flight, across all
relays: the next one is claimed after the previous one's publish committed. (The
previous one locked by another relay is still pending, so its successor is not
claimable; ``django_outbox.outbox`` makes sure rows of one key are numbered in commit
order.) A key publishes one event per batch; keys proceed in parallel; events without
a key are not held back at all. An event that keeps failing holds its key back until
``EXPLICIT_OUTBOX_MAX_ATTEMPTS``, then goes to the dead letters and the key moves on.

**Why ``task.apply_async`` and not ``app.send_task``.** ``apply_async`` is exactly what
a direct publish would have done: the task's own routing and options (``queue``,
``priority``, its serializer) apply, and an ExplicitTask binds the arguments, sets
the ``idempotency_key`` header and claims its dedup id with the code that does it
for every publish. ``send_task`` knows only a name. It also means the relay's registry
decides: a task name it does not know goes to the dead letters (``unknown_task``)
instead of to a queue no worker reads.

**Batches are pipelined** (kombu's ``Producer.batch``: one Redis round trip for the
whole batch); on a transport without batching, messages go one by one.

**Failures.** The broker down (or the Redis that holds dedup ids): nothing of that
batch is marked published, the relay backs off (capped, full jitter) and tries again
by itself. One event failing by itself (``BadInput`` after a deploy changed the
task, anything else its publish raises) never stops the relay: bad input and unknown
tasks go to the dead letters at once; other errors are recorded on the row
(``attempts``, ``last_error``) and retried after a backoff of its own.

**Wake-up.** On PostgreSQL the writer NOTIFYs in its transaction, delivered at commit;
the relay LISTENs on a dedicated connection and claims at once. Without it (SQLite,
or ``EXPLICIT_OUTBOX_NOTIFY_CHANNEL = ""``) it polls every
``EXPLICIT_OUTBOX_POLL_INTERVAL`` seconds; SQLite has no ``SKIP LOCKED``: run one
relay there.

**Stopping.** ``stop()`` (SIGTERM, SIGINT) lets the batch in hand finish and commit,
then ``run()`` returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import select
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery, Task
from celery.exceptions import QueueNotFound
from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.module_loading import autodiscover_modules
from kombu import exceptions as kombu_exceptions
from kombu.exceptions import OperationalError
from prometheus_client import Counter, Histogram

from celery_explicit import idempotency, ordering
from celery_explicit.errors import BadInput, qualname
from celery_explicit.metrics import dead_letters as dead_letters_total
from celery_explicit.retry_policy import backoff_delay
from django_outbox import dead_letters
from django_outbox.conf import settings
from django_outbox.models import DeadLetterReason, OutboxEvent, OutboxStatus

logger = logging.getLogger("django_outbox.relay")

published_total = Counter(
    "explicit_outbox_published_total",
    "Outbox events published to the broker (delivery layer). A relay that died "
    "mid-batch publishes its events again: the consumer's idempotency absorbs them.",
    ["task"],
)
publish_lag = Histogram(
    "explicit_outbox_publish_lag_seconds",
    "Seconds from an outbox row's insert to its publish (delivery layer).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600),
)
publish_failed = Counter(
    "explicit_outbox_publish_failed_total",
    "Publishes of one outbox event that failed by themselves (not a broker outage); "
    "the event is retried after a backoff, then dead-lettered.",
    ["task", "error_class"],
)
dead_lettered = Counter(
    "explicit_outbox_dead_lettered_total",
    "Outbox events sent to the dead letters instead of the broker, by reason.",
    ["task", "reason"],
)
deduplicated = Counter(
    "explicit_outbox_deduplicated_total",
    "Outbox events not published because another message owns their dedup id.",
    ["task"],
)
broker_unavailable = Counter(
    "explicit_outbox_broker_unavailable_total",
    "Batches the relay could not publish because the broker was unreachable; it "
    "backs off and publishes them later.",
)

# kombu >= 5.7: a pipelined batch whose flush failed (delivery uncertain).
_BatchPublishError: type[Exception] = getattr(
    kombu_exceptions, "BatchPublishError", OperationalError
)
_TABLE = OutboxEvent._meta.db_table
_PENDING = OutboxStatus.PENDING.value


def resolve_celery_settings(app: Celery) -> None:
    """Look every Celery setting up once and keep the values on the app.

    With ``config_from_object("django.conf:settings", namespace="CELERY")`` each lookup
    of a setting the project left at its default tries the prefixed and the plain name
    in the app's changes and in Django's settings (each miss an exception) before
    reaching Celery's defaults; ``apply_async`` makes dozens per message. Measured here:
    629 µs per ``apply_async`` before, 517 µs after. The relay is a process of its own
    whose settings do not change while it runs, so ``manage.py outbox_relay`` calls
    this once; do not call it in a process whose settings tests override.
    """
    from celery.app import defaults

    conf = app.conf
    conf.update({key: conf[key] for key in defaults.DEFAULTS})


@dataclass(frozen=True)
class Claimed:
    """The columns of a claimed outbox row that publishing needs (no model instance:
    building one per row costs more than the claim's own query)."""

    id: int
    event_id: str
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    options: dict[str, Any]
    ordering_key: str
    attempts: int
    created_at: datetime
    #: What is wrong with a row whose columns do not have the shapes the relay
    #: writes (an older row, a hand-made one): it is dead-lettered, not published.
    malformed: str = ""

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Claimed:
        id_, event_id, task_name, args, kwargs, headers, options, key, attempts, created = row
        values = {
            "args": (_json(args), list),
            "kwargs": (_json(kwargs), dict),
            "headers": (_json(headers), dict),
            "options": (_json(options), dict),
        }
        wrong = [
            f"{name} is {type(value).__name__}, not {kind.__name__}"
            for name, (value, kind) in values.items()
            if not isinstance(value, kind)
        ]
        # A malformed column is replaced by an empty one so the dead letter can be
        # written; the original stays on the outbox row.
        clean = {
            name: value if isinstance(value, kind) else kind()
            for name, (value, kind) in values.items()
        }
        return cls(
            id=id_,
            event_id=str(event_id),
            task_name=task_name,
            ordering_key=key,
            attempts=attempts,
            created_at=_aware(created),
            malformed="; ".join(wrong),
            **clean,
        )


@dataclass
class BatchResult:
    """What one ``relay_batch()`` did."""

    claimed: int = 0
    #: Events with an ordering key were among those claimed.
    keyed: bool = False
    published: int = 0
    deduplicated: int = 0
    dead_lettered: int = 0
    failed: int = 0
    #: The broker (or the dedup Redis) was unreachable: nothing of the batch that
    #: depended on it was marked; the relay backs off.
    broker_error: BaseException | None = None

    def add(self, other: BatchResult) -> None:
        self.claimed += other.claimed
        self.published += other.published
        self.deduplicated += other.deduplicated
        self.dead_lettered += other.dead_lettered
        self.failed += other.failed
        self.broker_error = other.broker_error


class Relay:
    """Publishes pending outbox events. One per process; several processes may run."""

    # The claim, as SQL. ``{head_of_key}`` keeps one event per ordering key in flight;
    # ``{lock}`` keeps two relays off the same rows (see the module docstring). The
    # tests' negative controls replace these two clauses to show what each prevents.
    claim_template = """
        WITH claimed AS {materialized} (
            SELECT event.id
            FROM {table} AS event
            WHERE event.status = '{pending}'
              AND event.available_at <= {now}
              {head_of_key}
            ORDER BY event.id
            LIMIT %s
            {lock}
        )
        SELECT event.id, event.event_id, event.task_name, event.args, event.kwargs,
               event.headers, event.options, event.ordering_key, event.attempts,
               event.created_at
        FROM {table} AS event
        WHERE event.id IN (SELECT id FROM claimed)
        ORDER BY event.id
    """
    head_of_key_clause = """
              AND (event.ordering_key = '' OR NOT EXISTS (
                    SELECT 1 FROM {table} AS earlier
                    WHERE earlier.ordering_key = event.ordering_key
                      AND earlier.status = '{pending}'
                      AND earlier.id < event.id))
    """
    lock_clause = "FOR UPDATE OF event SKIP LOCKED"

    def __init__(
        self,
        *,
        batch_size: int | None = None,
        poll_interval: float | None = None,
        notify_channel: str | None = None,
        using: str | None = None,
        app: Celery | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.batch_size = batch_size or settings.outbox_batch_size
        self.poll_interval = (
            poll_interval if poll_interval is not None else settings.outbox_poll_interval
        )
        self.notify_channel = (
            notify_channel if notify_channel is not None else settings.outbox_notify_channel
        )
        self.using = using or settings.database
        self.max_attempts = settings.outbox_max_attempts
        self.backoff_base = settings.outbox_backoff_base
        self.backoff_cap = settings.outbox_backoff_cap
        self.app = app or settings.celery_app()
        self._rng = rng or random.SystemRandom()
        self.stopping = False
        # stop() writes here; every wait selects on it, so a SIGTERM ends a poll wait
        # or a backoff at once instead of after it.
        self._stop_read, self._stop_write = os.pipe()
        self._stop_fds: tuple[int, ...] = (self._stop_read, self._stop_write)
        os.set_blocking(self._stop_write, False)
        self._broker: Any = None
        self._producer: Any = None
        # The registry decides what is unknown: import every app's tasks module the
        # way Django's autodiscovery (and manage.py check) does.
        autodiscover_modules("tasks")
        self.app.finalize(auto=True)

    # --- running -------------------------------------------------------------------

    def run(self, *, on_ready: Callable[[Wakeup], None] | None = None) -> BatchResult:
        """Relay until ``stop()``; returns the totals. ``on_ready`` is called once
        listening (or polling) has started, before the first claim."""
        totals = BatchResult()
        # LISTEN before the first claim: a commit between that claim and the first
        # wait is then waiting in the connection, not lost.
        wakeup = self.wakeup()
        if on_ready is not None:
            on_ready(wakeup)
        outages = 0
        try:
            while not self.stopping:
                try:
                    result = self.relay_batch()
                except DatabaseError as exc:
                    outages += 1
                    self._back_off(outages, "database unavailable", exc)
                    connections[self.using].close()
                    continue
                totals.add(result)
                if result.broker_error is not None:
                    outages += 1
                    broker_unavailable.inc()
                    self._back_off(outages, "broker unavailable", result.broker_error)
                    continue
                outages = 0
                if result.claimed == 0 or (result.claimed < self.batch_size and not result.keyed):
                    # Nothing more is claimable now: a short batch without ordering
                    # keys took everything pending (a commit since then has its NOTIFY
                    # waiting, so the wait returns at once). After keyed events, look
                    # again at once: each key's next event became claimable only when
                    # this batch committed, and nothing announces it.
                    wakeup.wait(self.poll_interval)
        finally:
            wakeup.close()
            self._close_broker()
        return totals

    def drain(self) -> BatchResult:
        """Relay until nothing is claimable or the broker fails (tests, benchmarks)."""
        totals = BatchResult()
        while True:
            result = self.relay_batch()
            totals.add(result)
            if result.claimed == 0 or result.broker_error is not None:
                return totals

    def stop(self) -> None:
        """Finish the batch in hand, then return from ``run()``. Safe in a signal handler."""
        self.stopping = True
        if self._stop_fds:
            # A full pipe is readable already: nothing more to say.
            with contextlib.suppress(BlockingIOError):
                os.write(self._stop_write, b"x")

    def close(self) -> None:
        """Release the broker connection and the stop pipe."""
        self._close_broker()
        # Once only: a second close could hit a descriptor number reused meanwhile.
        fds, self._stop_fds = self._stop_fds, ()
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def wakeup(self) -> Wakeup:
        """LISTEN/NOTIFY on PostgreSQL when a channel is set, else polling."""
        connection = connections[self.using]
        if connection.vendor == "postgresql" and self.notify_channel:
            return ListenWakeup(connection, self.notify_channel, self._stop_read)
        return Wakeup(self._stop_read)

    # --- one batch -----------------------------------------------------------------

    def relay_batch(self) -> BatchResult:
        """Claim, publish, mark and commit one batch."""
        result = BatchResult()
        with transaction.atomic(using=self.using):
            with connections[self.using].cursor() as cursor:
                cursor.execute(self.claim_sql(), [self.batch_size])
                events = [Claimed.from_row(row) for row in cursor.fetchall()]
            result.claimed = len(events)
            if not events:
                return result
            result.keyed = any(event.ordering_key for event in events)
            sent: list[Claimed] = []
            dropped: list[Claimed] = []
            producer = None
            with ordering.record_numbers() as taken:
                try:
                    producer = self._get_producer()
                    # max_size: a whole batch in one pipeline (two commands a message at
                    # most).
                    with _batch(producer, max_size=2 * len(events) + 1):
                        for event in events:
                            outcome = self._publish(event, producer)
                            if outcome is OutboxStatus.PUBLISHED:
                                sent.append(event)
                            elif outcome is OutboxStatus.DEDUPLICATED:
                                dropped.append(event)
                            elif outcome is OutboxStatus.DEAD_LETTER:
                                result.dead_lettered += 1
                            else:
                                result.failed += 1
                except self._broker_errors() as exc:
                    result.broker_error = exc
                    if producer is None or getattr(producer, "supports_batch_publish", False):
                        # Buffered messages were discarded, or the flush failed with an
                        # uncertain outcome: publish them all again later (at least
                        # once). They take new numbers in their entities' order then;
                        # give these back, or the entities' later jobs would wait for
                        # them until their ordering gap.
                        sent.clear()
                        self._give_back_numbers(taken)
                    self._close_broker()
            if connections[self.using].vendor == "postgresql":
                # The marks need not wait for the WAL flush: lost in a server crash,
                # they leave their events pending, and those are published again (at
                # least once, as after a relay crash). The flush was the largest cost
                # of a small batch.
                with connections[self.using].cursor() as cursor:
                    cursor.execute("SET LOCAL synchronous_commit TO OFF")
            self._mark(sent, OutboxStatus.PUBLISHED)
            self._mark(dropped, OutboxStatus.DEDUPLICATED)
        result.published = len(sent)
        result.deduplicated = len(dropped)
        now = timezone.now()
        for event in sent:
            published_total.labels(event.task_name).inc()
            publish_lag.observe(max(0.0, (now - event.created_at).total_seconds()))
        for event in dropped:
            deduplicated.labels(event.task_name).inc()
        if sent:
            logger.debug("published %d outbox events", len(sent), extra={"layer": "delivery"})
        return result

    def claim_sql(self) -> str:
        connection = connections[self.using]
        postgresql = connection.vendor == "postgresql"
        return self.claim_template.format(
            table=_TABLE,
            pending=_PENDING,
            materialized="MATERIALIZED" if postgresql else "",
            # SQLite: Django turns %% into % (the query has parameters).
            now="now()" if postgresql else "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')",
            head_of_key=self.head_of_key_clause.format(table=_TABLE, pending=_PENDING),
            lock=self.lock_clause if postgresql else "",
        )

    def _publish(self, event: Claimed, producer: Any) -> OutboxStatus | None:
        """Publish one event; returns its new status, None if it stays pending."""
        if event.malformed:
            self._dead_letter(
                event,
                DeadLetterReason.BAD_INPUT,
                error_class="django_outbox.relay.MalformedEvent",
                message=f"outbox event columns have the wrong shape: {event.malformed}",
            )
            return OutboxStatus.DEAD_LETTER
        task: Task[Any, Any] | None = self.app.tasks.get(event.task_name)
        if task is None:
            self._dead_letter(
                event,
                DeadLetterReason.UNKNOWN_TASK,
                error_class="celery.exceptions.NotRegistered",
                message=f"outbox event names task {event.task_name!r}, which is not "
                "registered in the relay: not published",
            )
            return OutboxStatus.DEAD_LETTER
        event_id = event.event_id
        try:
            sent = task.apply_async(
                tuple(event.args),
                event.kwargs,
                task_id=event_id,
                producer=producer,
                headers=dict(event.headers),
                # Fail fast: the relay's own backoff replaces Celery's publish retries,
                # which would hold the whole batch (and its row locks) meanwhile.
                retry=False,
                **event.options,
            )
        except BadInput as exc:
            self._dead_letter(
                event, DeadLetterReason.BAD_INPUT, error_class=qualname(exc), message=str(exc)
            )
            return OutboxStatus.DEAD_LETTER
        except QueueNotFound as exc:
            # A KeyError, which kombu's Redis transport counts among its connection
            # errors: caught first, or one event naming a removed queue would look like
            # a broker outage and hold the whole outbox back forever.
            return self._fail(event, exc)
        except self._broker_errors():
            raise
        except Exception as exc:
            # Anything else this one event raises is its own problem: it must not stop
            # the events after it.
            return self._fail(event, exc)
        # An ExplicitTask with a dedup_key publishes nothing when another message
        # owns the id, and hands back that message's id instead.
        if sent is not None and getattr(sent, "id", event_id) != event_id:
            return OutboxStatus.DEDUPLICATED
        return OutboxStatus.PUBLISHED

    @staticmethod
    def _give_back_numbers(taken: list[tuple[str, int]]) -> None:
        import redis

        for key, seq in taken:
            try:
                ordering.give_back(key, seq)
            except redis.RedisError:
                logger.warning(
                    "ordering %s: could not give number %d back (its entity waits out "
                    "its ordering gap)",
                    key,
                    seq,
                )

    def _mark(self, events: list[Claimed], status: OutboxStatus) -> None:
        if not events:
            return
        fields: dict[str, Any] = {"status": status, "attempts": F("attempts") + 1}
        if status is OutboxStatus.PUBLISHED:
            fields["published_at"] = Now()
        OutboxEvent.objects.using(self.using).filter(id__in=[e.id for e in events]).update(**fields)

    def _fail(self, event: Claimed, exc: Exception) -> OutboxStatus | None:
        """Back the event off, or dead-letter it past its attempts."""
        attempts = event.attempts + 1
        error_class = qualname(exc)
        message = f"{error_class}: {exc}"
        publish_failed.labels(event.task_name, error_class).inc()
        if attempts >= self.max_attempts:
            self._dead_letter(
                event,
                DeadLetterReason.EXHAUSTED,
                error_class=error_class,
                message=f"outbox event failed to publish {attempts} times: {message}",
            )
            return OutboxStatus.DEAD_LETTER
        delay = backoff_delay(attempts, base=self.backoff_base, cap=self.backoff_cap, rng=self._rng)
        OutboxEvent.objects.using(self.using).filter(id=event.id).update(
            attempts=F("attempts") + 1,
            last_error=message[:4000],
            available_at=Now() + timedelta(seconds=delay),
        )
        logger.warning(
            "outbox event %s (%s) failed to publish, attempt %d; next try in %.1fs: %s",
            event.event_id,
            event.task_name,
            attempts,
            delay,
            message,
            extra=self._fields(event, error_class=error_class, attempt=attempts),
        )
        return None

    def _dead_letter(
        self, event: Claimed, reason: DeadLetterReason, *, error_class: str, message: str
    ) -> None:
        """Record the dead letter and close the event, in the batch's transaction."""
        dead_letters.record(
            task_id=str(event.event_id),
            task_name=event.task_name,
            reason=reason,
            args=event.args,
            kwargs=event.kwargs,
            idempotency_key=str(event.headers.get(idempotency.KEY_HEADER) or ""),
            error_class=error_class,
            error_message=message,
            attempts=event.attempts + 1,
            correlation_id=str(event.headers.get(idempotency.CORRELATION_HEADER) or ""),
            queue=str(event.options.get("queue") or ""),
        )
        OutboxEvent.objects.using(self.using).filter(id=event.id).update(
            status=OutboxStatus.DEAD_LETTER,
            attempts=F("attempts") + 1,
            last_error=message[:4000],
        )
        dead_lettered.labels(event.task_name, reason.value).inc()
        dead_letters_total.labels(event.task_name, reason.value).inc()
        logger.error(
            "outbox event %s dead-lettered (%s): %s",
            event.event_id,
            reason.value,
            message,
            extra=self._fields(event, error_class=error_class, reason=reason.value),
        )

    @staticmethod
    def _fields(event: Claimed, **more: Any) -> dict[str, Any]:
        return {
            "task": event.task_name,
            "job_id": str(event.event_id),
            "idempotency_key": str(event.headers.get(idempotency.KEY_HEADER) or ""),
            "ordering_key": event.ordering_key,
            "layer": "delivery",
            **more,
        }

    # --- the broker ----------------------------------------------------------------

    def _get_producer(self) -> Any:
        if self._producer is None:
            self._broker = self.app.connection_for_write()
            self._producer = self.app.amqp.Producer(self._broker, auto_declare=False)
        return self._producer

    def _close_broker(self) -> None:
        """Drop the connection after a failure: the next batch starts a fresh one."""
        broker, self._broker, self._producer = self._broker, None, None
        if broker is not None:
            try:
                broker.collect()
            except Exception:  # a dead connection may fail to close; it is dropped anyway
                logger.debug("closing the broker connection failed", exc_info=True)

    def _broker_errors(self) -> tuple[type[BaseException], ...]:
        import redis

        transport_errors: tuple[type[BaseException], ...] = ()
        if self._broker is not None:
            transport_errors = tuple(self._broker.connection_errors)
        return (
            OperationalError,
            _BatchPublishError,
            ConnectionError,
            TimeoutError,
            redis.ConnectionError,
            redis.TimeoutError,
            # The Redis holding dedup ids and ordering numbers failing over or full:
            # an outage to wait out, not a fault of the event at hand.
            redis.exceptions.ReadOnlyError,
            redis.exceptions.OutOfMemoryError,
            redis.exceptions.TryAgainError,
            redis.exceptions.BusyLoadingError,
            *transport_errors,
        )

    def _back_off(self, outages: int, what: str, exc: BaseException) -> None:
        delay = backoff_delay(outages, base=self.backoff_base, cap=self.backoff_cap, rng=self._rng)
        logger.warning(
            "outbox relay: %s (%s: %s); backing off %.2fs (outage #%d)",
            what,
            qualname(exc),
            exc,
            delay,
            outages,
            extra={"layer": "delivery", "error_class": qualname(exc)},
        )
        Wakeup(self._stop_read).wait(delay)


class Wakeup:
    """Waits for a reason to look at the outbox again: the poll interval, or ``stop()``."""

    kind = "polling"

    def __init__(self, stop_fd: int) -> None:
        self._stop_fd = stop_fd

    def wait(self, timeout: float) -> None:
        select.select([self._stop_fd], [], [], timeout)

    def close(self) -> None:
        pass


class ListenWakeup(Wakeup):
    """PostgreSQL: also a NOTIFY on the channel, on a dedicated autocommit connection.

    Django's own connection is in and out of transactions; a LISTEN there would be
    lost whenever Django closes it. A lost listening connection is reconnected on the
    next wait, which then returns at once: a NOTIFY sent meanwhile is gone.
    """

    kind = "LISTEN/NOTIFY"

    def __init__(self, connection: Any, channel: str, stop_fd: int) -> None:
        super().__init__(stop_fd)
        self._params = connection.get_connection_params()
        self._channel = channel
        self._listener: Any = None
        self._connect()

    def _connect(self) -> bool:
        import psycopg
        from psycopg import sql

        try:
            listener = psycopg.connect(**self._params, autocommit=True)
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            logger.warning(
                "outbox relay: cannot LISTEN on %r (%s); polling until it can",
                self._channel,
                exc,
            )
            return False
        self._listener = listener
        return True

    def wait(self, timeout: float) -> None:
        import psycopg

        if self._listener is None:
            if self._connect():
                return  # notifications sent while we were not listening are lost
            super().wait(timeout)
            return
        ready, _, _ = select.select([self._stop_fd, self._listener.fileno()], [], [], timeout)
        if self._listener.fileno() in ready:
            try:
                for _notify in self._listener.notifies(timeout=0):
                    pass  # one wake-up is enough: the claim reads whatever committed
            except psycopg.Error:
                self.close()

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()


def _batch(producer: Any, *, max_size: int) -> contextlib.AbstractContextManager[Any]:
    """kombu >= 5.7 batches publishes into one pipeline; older kombu sends each at once."""
    if hasattr(producer, "batch"):
        return producer.batch(max_size=max_size)  # type: ignore[no-any-return]
    return contextlib.nullcontext()


def _aware(value: datetime | str) -> datetime:
    # SQLite hands a raw cursor a naive datetime (or text): stored in UTC (USE_TZ).
    parsed = parse_datetime(value) if isinstance(value, str) else value
    if parsed is None:
        raise ValueError(f"created_at {value!r} is not a datetime")
    return parsed if timezone.is_aware(parsed) else timezone.make_aware(parsed, UTC)


def _json(value: Any) -> Any:
    # Django's psycopg setup hands jsonb over as text (JSONField decodes it itself).
    return json.loads(value) if isinstance(value, str | bytes) else value
