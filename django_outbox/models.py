"""What the jobs leave behind as data: the ledger, the attempts, the dead letters.

Each model answers one operator question:
- ``ProcessedOperation``, the ledger: did the effect for this key happen, when, with
  what result? One ledger entry per key.
- ``Attempt``, the attempts: every time a worker ran the handler, and how it ended.
- ``DeadLetter``: messages that will not run again by themselves, and why.
- ``Fence``: which execution of a job took its lease over, so a paused one that wakes
  up cannot commit.
- ``OutboxEvent``: a job or event committed with the business change, waiting for the
  relay to publish it.
- ``PruneRecord``: when was each table last pruned?
- ``KeyTemplate``: the key templates workers started with (a renamed key's history).
"""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

# Re-exported: the enums of our data are the Celery side's words (celery_explicit.outcomes).
from celery_explicit.outcomes import DeadLetterReason as DeadLetterReason
from celery_explicit.outcomes import Outcome as Outcome


class DeadLetterStatus(models.TextChoices):
    OPEN = "open", "open"
    REPLAYED = "replayed", "replayed"
    DISCARDED = "discarded", "discarded"


def _app_version(did: str) -> models.CharField[str, str]:
    """The version of the code that wrote a row (``celery_explicit.app_version``); a
    database default, so adding the column rewrites no table."""
    return models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        help_text=f"version of the code that {did} (celery_explicit.app_version)",
    )


class ProcessedOperation(models.Model):
    """The ledger: one ledger entry per idempotency key whose effect committed.

    Written in the effect's own transaction (``store.ledger.effect``): an entry exists
    if and only if the effect committed."""

    # The key is the primary key: its unique index is the claim (no second index).
    key = models.CharField(max_length=255, primary_key=True)
    task_name = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="sha256 of the call's arguments")
    result_ref = models.CharField(max_length=255, blank=True, default="")
    processed_at = models.DateTimeField()
    app_version = _app_version("applied it")

    class Meta:
        db_table = "django_outbox_processed_operation"
        verbose_name = "ledger entry"
        verbose_name_plural = "ledger entries"
        indexes = [
            models.Index(fields=["processed_at"], name="django_outbox_processed_at_idx"),
        ]

    def __str__(self) -> str:
        return self.key


class Fence(models.Model):
    """The newest fencing token of a job whose execution lease was taken over.

    Written only by a takeover (the holder was paused, stopped or dead); a stale
    execution that wakes up reads it in its effect's commit and is refused.
    """

    task_id = models.CharField(max_length=255, primary_key=True)
    token = models.BigIntegerField()
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    taken_over_from = models.CharField(
        max_length=255, blank=True, default="", help_text="the previous holder (host:pid)"
    )
    taken_over_at = models.DateTimeField()
    # The execution taken over, which may have left no attempt row (a killed process
    # writes none): when it took its lease (Redis's clock) and why it lost it. Written
    # by the takeover itself: nothing on the common path.
    holder_started_at = models.DateTimeField(
        null=True, blank=True, help_text="when the previous holder took its lease"
    )
    cause = models.CharField(
        max_length=16,
        blank=True,
        default="",
        db_default="",
        help_text="holder_dead or lease_expired (celery_explicit.execution_lease); unleased: "
        "a redelivery that found the lease free, naming no holder",
    )

    class Meta:
        db_table = "django_outbox_fence"
        verbose_name = "fence (lease takeover)"
        verbose_name_plural = "fences (lease takeovers)"

    def __str__(self) -> str:
        return f"{self.task_id} >= {self.token}"


class Attempt(models.Model):
    """One execution of a handler by a worker: the attempts."""

    task_id = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    attempt = models.PositiveIntegerField(help_text="1 for the first try; retries add one")
    redelivered = models.BooleanField(
        default=False, help_text="the broker marked this delivery as a redelivery"
    )
    worker_host = models.CharField(max_length=255, blank=True, default="")
    worker_pid = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    duration_ms = models.FloatField()
    outcome = models.CharField(max_length=32, choices=Outcome.choices)
    error_class = models.CharField(max_length=255, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    retry_delay = models.FloatField(
        null=True, blank=True, help_text="seconds until the next attempt"
    )
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    correlation_id = models.CharField(max_length=255, blank=True, default="")
    external_request_id = models.CharField(max_length=255, blank=True, default="")
    replay_of = models.BigIntegerField(
        null=True, blank=True, help_text="id of the dead letter this replays"
    )
    # How the job was first published, and its deferrals before this attempt (by step):
    # carried in the message's headers, no write of their own. db_default: rows
    # written by hand (bench/benchapp's floor) need not name them.
    published_via = models.CharField(
        max_length=16,
        blank=True,
        default="",
        db_default="",
        help_text="direct, on_commit or outbox",
    )
    deferrals = models.JSONField(
        null=True, blank=True, help_text="deferrals before this attempt, by step"
    )
    published_key = models.CharField(
        max_length=255,
        blank=True,
        default="",
        db_default="",
        help_text="the key the message was published with, where it differs from the key "
        "this worker rendered (a renamed template)",
    )
    # When its message was published (its explicit_sent_at header): the wait in the
    # queue before this execution, with no write of its own.
    sent_at = models.DateTimeField(
        null=True, blank=True, help_text="when the message this attempt ran was published"
    )
    app_version = _app_version("ran it")

    class Meta:
        db_table = "django_outbox_attempt"
        constraints = [
            models.CheckConstraint(
                condition=Q(attempt__gte=1), name="django_outbox_attempt_number_gte_1"
            ),
            models.CheckConstraint(
                condition=Q(outcome__in=Outcome.values), name="django_outbox_attempt_outcome_valid"
            ),
        ]
        indexes = [
            models.Index(
                fields=["idempotency_key", "started_at"], name="django_outbox_attempt_key_idx"
            ),
            models.Index(fields=["task_id"], name="django_outbox_attempt_task_idx"),
            models.Index(fields=["outcome", "started_at"], name="django_outbox_attempt_outc_idx"),
            # explain: the attempts a replay led to. Partial: most rows replay nothing.
            models.Index(
                fields=["replay_of"],
                name="django_outbox_att_replay_idx",
                condition=Q(replay_of__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] #{self.attempt}: {self.outcome}"


class KeyTemplate(models.Model):
    """A task's idempotency key template, as a worker started with it: the history
    that lets a renamed template find the effects applied under the old one
    (``celery_explicit.key_history``)."""

    task_name = models.CharField(max_length=255)
    template = models.CharField(max_length=255)
    first_seen = models.DateTimeField()
    last_seen = models.DateTimeField()

    class Meta:
        db_table = "django_outbox_key_template"
        constraints = [
            models.UniqueConstraint(
                fields=["task_name", "template"], name="django_outbox_key_template_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.task_name}: {self.template}"


class Dashboard(Attempt):
    """The attempts again, no table of its own: a proxy only because the admin lists a
    page in its index through a model. Its entry opens the dashboard
    (``admin.dashboard``), readable by whoever may read the attempts."""

    class Meta:
        proxy = True
        verbose_name = "dashboard"
        verbose_name_plural = "dashboard"


class DeadLetter(models.Model):
    """A message that will not run again by itself. Evidence: read-only in the admin."""

    task_id = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    raw_body = models.TextField(
        blank=True, default="", help_text="the message body, when it could not be decoded"
    )
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    reason = models.CharField(max_length=32, choices=DeadLetterReason.choices)
    error_class = models.CharField(max_length=255, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    traceback = models.TextField(blank=True, default="")
    attempts = models.PositiveIntegerField(default=1)
    first_seen = models.DateTimeField()
    last_attempt = models.DateTimeField()
    correlation_id = models.CharField(max_length=255, blank=True, default="")
    queue = models.CharField(
        max_length=255,
        blank=True,
        default="",
        help_text="routing key it was consumed from; replays go back there",
    )
    exchange = models.CharField(
        max_length=255,
        blank=True,
        default="",
        db_default="",
        help_text="exchange it was delivered through; replays are published there",
    )
    status = models.CharField(
        max_length=16, choices=DeadLetterStatus.choices, default=DeadLetterStatus.OPEN
    )
    replayed_task_id = models.CharField(max_length=255, blank=True, default="")
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=150, blank=True, default="")
    app_version = _app_version("wrote it")

    class Meta:
        db_table = "django_outbox_dead_letter"
        permissions = [
            ("replay_deadletter", "Can replay a dead letter"),
            ("discard_deadletter", "Can discard a dead letter"),
        ]
        constraints = [
            # A redelivered message that fails again updates its dead letter.
            models.UniqueConstraint(fields=["task_id"], name="django_outbox_dl_task_uniq"),
            models.CheckConstraint(
                condition=Q(reason__in=DeadLetterReason.values),
                name="django_outbox_dl_reason_valid",
            ),
        ]
        indexes = [
            models.Index(fields=["status", "last_attempt"], name="django_outbox_dl_status_idx"),
            models.Index(fields=["idempotency_key"], name="django_outbox_dl_key_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]: {self.reason}"


class OutboxStatus(models.TextChoices):
    """Where an outbox event stands. Only ``pending`` events are ever claimed."""

    PENDING = "pending", "pending: not yet published"
    PUBLISHED = "published", "published to the broker"
    DEDUPLICATED = "deduplicated", "not published: another message owns its dedup id"
    DEAD_LETTER = "dead_letter", "not published: sent to the dead letters"


class OutboxEventQuerySet(models.QuerySet["OutboxEvent"]):
    def pending(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.PENDING)

    def backlog(self) -> tuple[int, datetime | None]:
        """How many events wait to be published, and when the oldest was written."""
        found = self.pending().aggregate(count=models.Count("id"), oldest=models.Min("created_at"))
        return int(found["count"]), found["oldest"]


class OutboxEvent(models.Model):
    """A job or domain event written in the business transaction, published after commit.

    ``manage.py explicit_relay`` publishes it with ``event_id`` as the Celery task id and
    marks it in the transaction that claimed it (``outbox.relay.loop``). ``id`` is the
    creation order: events sharing an ``ordering_key`` are published in it.
    """

    event_id = models.UUIDField(default=uuid.uuid4, editable=False, help_text="the task id")
    task_name = models.CharField(max_length=255, help_text="the topic: a registered task name")
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True, help_text="a domain event's payload")
    headers = models.JSONField(default=dict, blank=True)
    options = models.JSONField(
        default=dict, blank=True, help_text="publish options: queue, routing_key, ..."
    )
    ordering_key = models.CharField(
        max_length=255, blank=True, default="", help_text="events with one key publish in order"
    )
    status = models.CharField(
        max_length=16, choices=OutboxStatus.choices, default=OutboxStatus.PENDING
    )
    # The database's clock: the claim compares available_at with now(), and a writer
    # whose clock ran ahead would otherwise hold its events back.
    created_at = models.DateTimeField(db_default=Now())
    available_at = models.DateTimeField(
        db_default=Now(), help_text="not claimed before this time (backoff after a failure)"
    )
    published_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text="publish attempts")
    last_error = models.TextField(blank=True, default="")
    # outbox.relay.reconcile: when a worker's trace of the job was found (the event is
    # not looked at again), and how often it was published again for want of one.
    checked_at = models.DateTimeField(
        null=True, blank=True, help_text="a worker's trace of its job was found"
    )
    # db_default: django_outbox.outbox.events inserts rows with SQL of its own.
    republished = models.PositiveSmallIntegerField(
        default=0, db_default=0, help_text="published again: no worker had received it"
    )

    # django_outbox.outbox.prepared (EXPLICIT_OUTBOX_PREPARED_MESSAGES): the broker
    # message built when the row was written, and its layout and writer; "" when the
    # relay builds it. db_default: rows a writer of another version inserts with SQL
    # naming neither column.
    message = models.TextField(
        blank=True, default="", db_default="", help_text="the prepared broker message, if any"
    )
    message_format = models.CharField(
        max_length=100,
        blank=True,
        default="",
        db_default="",
        help_text="the prepared message's layout and the version that wrote it",
    )

    objects = OutboxEventQuerySet.as_manager()

    class Meta:
        db_table = "django_outbox_event"
        verbose_name = "outbox event"
        permissions = [("retry_outboxevent", "Can retry an outbox event now")]
        constraints = [
            models.UniqueConstraint(fields=["event_id"], name="django_outbox_event_id_uniq"),
            models.CheckConstraint(
                condition=Q(status__in=OutboxStatus.values), name="django_outbox_event_status_valid"
            ),
            # published_at says when it reached the broker: set for published rows only.
            models.CheckConstraint(
                condition=Q(status=OutboxStatus.PUBLISHED, published_at__isnull=False)
                | (~Q(status=OutboxStatus.PUBLISHED) & Q(published_at__isnull=True)),
                name="django_outbox_event_published_at",
            ),
        ]
        indexes = [
            # The relay's claim: pending rows in creation order (a partial index stays
            # as small as the backlog, however many published rows are kept).
            models.Index(
                fields=["id"],
                condition=Q(status=OutboxStatus.PENDING),
                name="django_outbox_ev_pending_idx",
            ),
            # The claim's "no older pending event with this key" test.
            models.Index(
                fields=["ordering_key", "id"],
                condition=Q(status=OutboxStatus.PENDING),
                name="django_outbox_ev_key_idx",
            ),
            # explicit_prune.
            models.Index(
                fields=["published_at"],
                condition=Q(status=OutboxStatus.PUBLISHED),
                name="django_outbox_ev_pub_idx",
            ),
            # outbox.relay.reconcile: published events without a worker's trace yet (as
            # small as the last reconcile_after seconds of publishes).
            models.Index(
                fields=["published_at"],
                condition=Q(status=OutboxStatus.PUBLISHED, checked_at__isnull=True),
                name="django_outbox_ev_unchecked_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.event_id}]: {self.status}"


class PruneRecord(models.Model):
    """When ``manage.py explicit_prune`` last finished a table, and how many rows it
    deleted then (``django_outbox.retention``; check W020 reads it)."""

    table = models.CharField(max_length=32, primary_key=True)
    pruned_at = models.DateTimeField()
    deleted = models.BigIntegerField(default=0)

    class Meta:
        db_table = "django_outbox_prune"
        verbose_name = "prune run"

    def __str__(self) -> str:
        return f"{self.table} pruned at {self.pruned_at}: {self.deleted} rows"


class Cancellation(models.Model):
    """An operator's cancellation of a job, by task id or by idempotency key
    (``celery_explicit.cancellation``): a cancellable job that has not started ends
    ``cancelled``, and its effect's commit is refused (``effect()`` reads this table in
    its own transaction). Kept as evidence: who, when, why."""

    task_id = models.CharField(max_length=255, blank=True, default="")
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    task_name = models.CharField(max_length=255, blank=True, default="")
    requested_by = models.CharField(max_length=150)
    requested_at = models.DateTimeField()
    reason = models.TextField(blank=True, default="")

    class Meta:
        db_table = "django_outbox_cancellation"
        indexes = [
            models.Index(fields=["task_id"], name="django_outbox_cancel_task_idx"),
            models.Index(fields=["idempotency_key"], name="django_outbox_cancel_key_idx"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=~Q(task_id="") | ~Q(idempotency_key=""),
                name="django_outbox_cancel_names_a_job",
            )
        ]

    def __str__(self) -> str:
        what = f"task {self.task_id}" if self.task_id else f"key {self.idempotency_key}"
        return f"{what} cancelled by {self.requested_by} at {self.requested_at}"


class PeriodicSlot(models.Model):
    """A schedule slot of a periodic entry that a beat published (``celery_explicit.
    periodic``): one row per (entry, slot), so a slot a beat never published (every beat
    down, a beat that never started) shows as a gap (``django_outbox.W016``), and
    ``explain`` says which slot a job ran for. Kept ``periodic_slots.KEEP`` seconds."""

    entry = models.CharField(max_length=200)
    slot = models.DateTimeField()
    task_name = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255)
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    published_at = models.DateTimeField()
    #: host:pid of the beat that published it.
    published_by = models.CharField(max_length=255, blank=True, default="")
    #: Where the entry's slots fall, as the beat saw its schedule (``every 60s``,
    #: ``crontab 0 * * * * UTC``): the expected slots are computed from it.
    grid = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        db_table = "django_outbox_periodic_slot"
        constraints = [
            models.UniqueConstraint(fields=["entry", "slot"], name="django_outbox_slot_once")
        ]
        indexes = [
            models.Index(fields=["task_id"], name="django_outbox_slot_task_idx"),
            models.Index(fields=["slot"], name="django_outbox_slot_time_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.entry} slot {self.slot:%Y-%m-%dT%H:%M:%SZ} as job {self.task_id}"
