"""The outbox relay: publishes committed outbox events, at least once, in order per key.

``manage.py explicit_relay`` runs ``Relay.run()``: claim a batch of pending events,
publish each through its Celery task with the event id as the task id, mark them, and
commit; then look again, or wait for a NOTIFY (PostgreSQL) or the poll interval.

Its parts, one concern each, beside it in ``django_outbox.outbox.relay``: the claim
(which rows, locked how, in which order per ordering key: ``claim``), the wake-up
(``wakeup``), the broker connection (``broker``), the message (``publish``, sent by
``celery_send``), the lost
(``reconcile``) and the metrics (``metrics``). This module is the loop and the publish
policy.

**At least once.** The claim and the marks are one transaction, and the messages are
sent before it commits. A relay that dies mid-batch leaves its events pending: another
relay (or itself, restarted) publishes them again. The consumer's idempotency key
absorbs the duplicate; the relay cannot tell a republish from a first publish (the
transaction that died left no trace), the consumer can: a second attempt with the
same task id, ``already_applied``. An event that keeps failing holds its ordering key
back until ``EXPLICIT_OUTBOX_MAX_ATTEMPTS``, then goes to the dead letters and the key
moves on.

**What ``task.apply_async`` would have sent, not ``app.send_task``.** Each event goes
out as the message its task's ``apply_async`` sends: the task's own routing and options
(``queue``, ``priority``, its serializer) apply, and an ExplicitTask binds the arguments
and sets the ``idempotency_key`` header (``BadInput`` is dead-lettered). ``send_task``
knows only a name. It also means the relay's registry decides: a task name it does not
know goes to the dead letters (``unknown_task``) instead of to a queue no worker reads.
For speed the message is sent through ``celery_send``, the one module that follows
Celery's own send path from its internals (settings read once a batch; linked to
Celery's source and checked by tests), with the headers ``celery_explicit.headers``
stamps for ``apply_async`` too; a task that claims Redis state at publish (a dedup id,
an ordering number), publishes in a way of its own, or runs on an untested Celery
still goes through ``apply_async``.

**The Celery app is read, never written.** Celery's settings are read from
``task.app.conf`` (once a batch, by the relay's message builder), as in any other
process. Copying the resolved settings into ``app.conf`` would save those look-ups, but
would turn each default into a project setting in the app's ``changes`` and hide later
changes of Django's settings from the app.

**Failures.** The broker down (or the Redis that holds dedup ids): nothing of that
batch is marked published, the relay backs off (capped, full jitter) and tries again
by itself. One event failing by itself (``BadInput`` after a deploy changed the
task, anything else its publish raises) never stops the relay: bad input and unknown
tasks go to the dead letters at once; other errors are recorded on the row
(``attempts``, ``last_error``) and retried after a backoff of its own. SQLite has no
``SKIP LOCKED``: run one relay there.

**Stopping.** ``stop()`` (SIGTERM, SIGINT) lets the batch in hand finish and commit,
then ``run()`` returns.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.module_loading import autodiscover_modules

from celery_explicit import job_log, ordering
from celery_explicit.errors import qualname
from celery_explicit.retry_policy import backoff_delay
from django_outbox.conf import settings
from django_outbox.db import libpq, relay_sql
from django_outbox.models import OutboxEvent, OutboxStatus
from django_outbox.outbox.relay import claim
from django_outbox.outbox.relay.broker import BrokerConnection, batch
from django_outbox.outbox.relay.claim import Claimed
from django_outbox.outbox.relay.metrics import (
    broker_unavailable,
    deduplicated,
    outbox_published,
    publish_lag,
)
from django_outbox.outbox.relay.publish import CeleryMessages, PublishPolicy
from django_outbox.outbox.relay.reconcile import Reconciled, Reconciler
from django_outbox.outbox.relay.wakeup import ListenWakeup, Wakeup, wakeup_for

# The relay and what a caller of it sees, importable from here (the management command,
# the tests).
__all__ = ["Relay", "BatchResult", "Claimed", "Wakeup", "ListenWakeup"]

logger = job_log.get_logger("django_outbox.outbox.relay.loop")


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
        self._broker = BrokerConnection(self.app)
        self.policy = PublishPolicy(
            app=self.app,
            using=self.using,
            broker=self._broker,
            max_attempts=self.max_attempts,
            backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap,
            rng=self._rng,
        )
        self._messages: CeleryMessages | None = None
        # Published events no worker received are published again (relay.reconcile).
        self.reconciler = Reconciler.from_settings(self.app, self.using)
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
                if self.reconciler.due():
                    self.reconcile()
                if result.claimed == 0 or (result.claimed < self.batch_size and not result.keyed):
                    # Nothing more is claimable now: a short batch without ordering
                    # keys took everything pending (a commit since then has its NOTIFY
                    # waiting, so the wait returns at once). After keyed events, look
                    # again at once: each key's next event became claimable only when
                    # this batch committed, and nothing announces it.
                    wakeup.wait(self.poll_interval)
        finally:
            wakeup.close()
            self._broker.close()
        return totals

    def drain(self) -> BatchResult:
        """Relay until nothing is claimable or the broker fails (tests, benchmarks)."""
        totals = BatchResult()
        while True:
            result = self.relay_batch()
            totals.add(result)
            if result.claimed == 0 or result.broker_error is not None:
                return totals

    def reconcile(self) -> Reconciled | None:
        """One reconciliation pass; a database outage waits for the next one."""
        try:
            return self.reconciler.run_once()
        except DatabaseError as exc:
            logger.warning(
                "outbox reconcile: database unavailable (%s: %s); next pass tries again",
                qualname(exc),
                exc,
                extra={"layer": "delivery", "error_class": qualname(exc)},
            )
            connections[self.using].close()
            return None

    def stop(self) -> None:
        """Finish the batch in hand, then return from ``run()``. Safe in a signal handler."""
        self.stopping = True
        if self._stop_fds:
            # A full pipe is readable already: nothing more to say.
            with contextlib.suppress(BlockingIOError):
                os.write(self._stop_write, b"x")

    def close(self) -> None:
        """Release the broker connection and the stop pipe."""
        self._broker.close()
        # Once only: a second close could hit a descriptor number reused meanwhile.
        fds, self._stop_fds = self._stop_fds, ()
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def wakeup(self) -> Wakeup:
        """LISTEN/NOTIFY on PostgreSQL when a channel is set, else polling."""
        return wakeup_for(connections[self.using], self.notify_channel, self._stop_read)

    # --- one batch -----------------------------------------------------------------

    def relay_batch(self) -> BatchResult:
        """Claim, publish, mark and commit one batch."""
        result = BatchResult()
        owns_transaction = not connections[self.using].in_atomic_block
        with transaction.atomic(using=self.using):
            events = self.claim()
            result.claimed = len(events)
            if not events:
                return result
            result.keyed = any(event.ordering_key for event in events)
            sent: list[Claimed] = []
            dropped: list[Claimed] = []
            producer = None
            with ordering.record_numbers() as taken:
                self._messages = None
                try:
                    producer = self._broker.producer()
                    self._messages = self.policy.messages(producer)
                    # max_size: a whole batch in one pipeline (two commands a message at
                    # most).
                    with batch(producer, max_size=2 * len(events) + 1):
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
                        # The prepared messages' pipeline (django_outbox.outbox.prepared).
                        self._messages.flush()
                except self._broker.errors() as exc:
                    result.broker_error = exc
                    if self._messages is not None and self._messages.unpushed:
                        # Not pushed, or pushed by a pipeline whose outcome is unknown:
                        # published again later (at least once).
                        unpushed = {id(event) for _k, _p, event, _t in self._messages.unpushed}
                        sent = [event for event in sent if id(event) not in unpushed]
                    if producer is None or getattr(producer, "supports_batch_publish", False):
                        # Buffered messages were discarded, or the flush failed with an
                        # uncertain outcome: publish them all again later (at least
                        # once). They take new numbers in their entities' order then;
                        # give these back, or the entities' later jobs would wait for
                        # them until their ordering gap.
                        sent.clear()
                        self._give_back_numbers(taken)
                    self._broker.close()
            self._mark(
                {OutboxStatus.PUBLISHED: sent, OutboxStatus.DEDUPLICATED: dropped},
                commit=owns_transaction,
            )
        result.published = len(sent)
        result.deduplicated = len(dropped)
        now = timezone.now()
        for event in sent:
            publish_lag.observe(max(0.0, (now - event.created_at).total_seconds()))
        # Counted per task once a batch: a labelled counter's look-up costs more than
        # its increment.
        for name, count in Counter(event.task_name for event in sent).items():
            outbox_published.labels(name).inc(count)
        for name, count in Counter(event.task_name for event in dropped).items():
            deduplicated.labels(name).inc(count)
        if sent:
            logger.debug("published %d outbox events", len(sent), extra={"layer": "delivery"})
        return result

    def claim(self) -> list[Claimed]:
        """Lock this batch's events (``claim.claim_batch``), in the batch's
        transaction. The tests' negative controls override it to take one safeguard of
        the claim out."""
        return claim.claim_batch(self.using, self.batch_size)

    def _publish(self, event: Claimed, producer: Any) -> OutboxStatus | None:
        """Publish one event through this batch's ``producer``; returns its new status,
        None if it stays pending."""
        messages = self._messages
        assert messages is not None, "relay_batch sets the batch's messages before publishing"
        return self.policy.publish(event, messages)

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

    def _mark(self, marks: dict[OutboxStatus, list[Claimed]], *, commit: bool) -> None:
        """Mark the batch's events with their new status. With ``commit`` (this batch's
        ``atomic()`` is the transaction) on PostgreSQL, the batch commits in the same
        round trip (``django_outbox.db.libpq``); ``atomic()`` then has nothing left
        to send."""
        marks = {status: events for status, events in marks.items() if events}
        if not marks:
            return
        connection = connections[self.using]
        if connection.vendor != "postgresql":
            for status, events in marks.items():
                fields: dict[str, Any] = {
                    "status": status,
                    "attempts": F("attempts") + 1,
                    "message": "",  # spent (relay_sql.MARK)
                }
                if status is OutboxStatus.PUBLISHED:
                    fields["published_at"] = Now()
                OutboxEvent.objects.using(self.using).filter(id__in=[e.id for e in events]).update(
                    **fields
                )
            return
        # One statement per status, every value a literal (relay_sql.MARK): the marks
        # and the COMMIT share one round trip where round_trips allows it.
        statements = [relay_sql.NO_FLUSH] + [
            relay_sql.MARK.format(
                status=OutboxStatus(status).value,
                published_at="statement_timestamp()"
                if status is OutboxStatus.PUBLISHED
                else "published_at",
                ids=",".join(str(int(e.id)) for e in events),
            )
            for status, events in marks.items()
        ]
        trips = libpq.for_commit(connection, settings.outbox_relay_round_trips) if commit else None
        if trips is not None:
            trips.commit_with(statements, what="the outbox relay's batch")
            return
        with connection.cursor() as cursor:
            cursor.execute(";".join(statements))

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
