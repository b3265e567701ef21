"""Retention: which rows of our tables may be deleted, when, and how.

Every job leaves rows behind: an attempt per execution, a ledger row per effect, a
fence per lease takeover, a dead letter per job that needs a human, an outbox event per
job published through the outbox. ``manage.py explicit_prune`` deletes those older
than their retention (``EXPLICIT_RETAIN_*``, seconds):

- **attempts** by ``started_at``; **fences** by ``taken_over_at``;
- **dead letters** resolved (replayed or discarded) by ``resolved_at``. An open dead
  letter is never pruned, however old: it is the evidence of a job nobody looked at;
- **outbox events** published by ``published_at``, once reconciliation is done with
  them (``django_outbox.outbox.relay.reconcile``: a worker's trace was found, ``checked_at`` set, or
  they are past ``EXPLICIT_OUTBOX_RECONCILE_HORIZON``, which it never looks beyond);
  dead-lettered and deduplicated events by ``created_at``. A pending event is never
  pruned, nor a published one the reconciler may still republish;
- **the effect ledger** by ``processed_at``, never below its floor.

**The ledger's floor.** A ledger row is what stops a second copy of a job from applying
its effect again. Deleted while a copy can still arrive, it lets that copy through: a
duplicate effect. How late a copy can arrive after the effect committed is bounded by
what the configuration allows, and the delays chain (a copy republished by the
reconciler at its horizon can be redelivered by the broker's backstop, retried through
its whole schedule, and deferred by a database outage on the way), so the floor is
their sum:

- the broker's backstop: Redis's ``visibility_timeout`` (a worker that died between
  its commit and its ack has its message redelivered that late) plus kombu's restore
  sweep; RabbitMQ's ``consumer_timeout``; on another broker the longest task lease;
- the longest retry schedule of a registered ExplicitTask: the ceilings of its
  ``max_attempts - 1`` backoff delays (``min(backoff_cap, backoff_base * 2**(n-1))``,
  ``celery_explicit.retry_policy``) and as many runs, each bounded by ``max_run_time``
  or else by its lease;
- reconciliation's horizon (when reconciliation is on): the relay republishes an event
  without a trace up to that long after its publish;
- the database outage backoff cap (when that deferral is on): a deferred copy comes
  back that long after the database does.

A dedup window is not a delay but a promise (a resend inside it is dropped at the
door), and the ledger must keep it at least as long: the floor is the longest dedup
window where that is longer than the sum. ``manage.py check`` reports a ledger
retention below the floor (E020) and ``explicit_prune`` refuses to prune the ledger
then.

**How.** Each table is pruned in batches: one short transaction selects up to
``batch_size`` due primary keys along an index (``FOR UPDATE SKIP LOCKED``: a row a
worker, the relay or the reconciler holds is left for the next run, and the lock keeps
its row from changing until the delete) and deletes them by key. Nothing is held
between batches, so a prune runs beside the workers, and a prune that is killed is run
again: it starts over from what is left. The cutoffs are the database's clock
(``now()``), as the reconciler's are. Attempts are selected per outcome along
``(outcome, started_at)``, the index the admin already keeps, so retention adds no index
to the table every job writes.

Each finished table is recorded in ``PruneRecord``; ``check --database default`` warns
(W020) when rows are past their retention and nothing has pruned for longer than the
shortest retention.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.db import DatabaseError, connections, models, transaction
from django.db.models import Max, Q
from django.db.models.functions import Now
from django.utils import timezone

from celery_explicit import retry_policy, worker_steps
from celery_explicit.errors import ContractError
from django_outbox.checks import reads_settings
from django_outbox.conf import settings
from django_outbox.models import (
    Attempt,
    DeadLetter,
    DeadLetterStatus,
    Fence,
    OutboxEvent,
    OutboxStatus,
    Outcome,
    ProcessedOperation,
    PruneRecord,
)

__all__ = [
    "TABLES",
    "Floor",
    "LedgerBelowFloor",
    "Term",
    "count",
    "human",
    "ledger_floor",
    "prune",
    "retention",
]

#: The tables ``explicit_prune`` knows, in the order it prunes them.
TABLES = ("attempts", "fences", "dead_letters", "outbox", "ledger")

# kombu's Redis transport defaults (kombu/transport/redis.py): the backstop, and the
# restore sweep every 10 s scanning on every 10th (as django_outbox.checks reads them).
REDIS_DEFAULT_VISIBILITY_TIMEOUT = 3600.0
REDIS_DEFAULT_SWEEP = (10.0, 10.0)


def setting_name(table: str) -> str:
    return f"EXPLICIT_RETAIN_{table.upper()}"


def retention(table: str) -> float:
    """The table's retention in seconds."""
    return float(getattr(settings, f"retain_{table}"))


# --- what is due ------------------------------------------------------------------------


def _due(table: str, seconds: float, using: str) -> list[models.QuerySet[Any]]:
    """The rows of ``table`` past ``seconds``, as querysets each ordered along an index
    (a batch is the first ``batch_size`` rows of one of them)."""
    cutoff = Now() - timedelta(seconds=seconds)
    if table == "attempts":
        # One per outcome, along (outcome, started_at): PostgreSQL before 18 cannot
        # skip-scan a composite index for "any outcome".
        return [
            Attempt.objects.using(using)
            .filter(outcome=outcome, started_at__lt=cutoff)
            .order_by("started_at")
            for outcome in Outcome.values
        ]
    if table == "fences":
        # A fence is written only on a lease takeover: a small table, scanned whole.
        return [Fence.objects.using(using).filter(taken_over_at__lt=cutoff).order_by("pk")]
    if table == "dead_letters":
        return [
            DeadLetter.objects.using(using)
            .filter(status=status, resolved_at__lt=cutoff)
            .order_by("status", "last_attempt")
            for status in (DeadLetterStatus.REPLAYED, DeadLetterStatus.DISCARDED)
        ]
    if table == "outbox":
        events = OutboxEvent._base_manager.using(using)
        return [
            events.filter(
                Q(status=OutboxStatus.PUBLISHED, published_at__lt=cutoff) & reconciled()
            ).order_by("published_at"),
            # Never published: the dead letter (if any) keeps the evidence. Few rows,
            # and the oldest have the lowest ids.
            events.filter(
                status__in=[OutboxStatus.DEAD_LETTER, OutboxStatus.DEDUPLICATED],
                created_at__lt=cutoff,
            ).order_by("pk"),
        ]
    if table == "ledger":
        return [
            ProcessedOperation.objects.using(using)
            .filter(processed_at__lt=cutoff)
            .order_by("processed_at")
        ]
    raise ValueError(f"unknown table {table!r}: one of {', '.join(TABLES)}")


def reconciled() -> Q:
    """Published events the reconciler is done with (``django_outbox.outbox.relay.reconcile``): it
    found a worker's trace (``checked_at``), or they are past its horizon, which it
    never looks beyond (it only marks them checked). With reconciliation off
    (``EXPLICIT_OUTBOX_RECONCILE_AFTER`` = 0) nothing is waiting for it."""
    if settings.outbox_reconcile_after <= 0:
        return Q()
    horizon = Now() - timedelta(seconds=settings.outbox_reconcile_horizon)
    return Q(checked_at__isnull=False) | Q(published_at__lt=horizon)


def count(table: str, *, using: str | None = None, seconds: float | None = None) -> int:
    """How many rows of ``table`` are past their retention (``--dry-run``)."""
    alias = using or settings.database
    seconds = retention(table) if seconds is None else seconds
    if not math.isfinite(seconds):
        return 0
    return sum(query.count() for query in _due(table, seconds, alias))


# --- deleting ---------------------------------------------------------------------------


def prune(
    table: str,
    *,
    using: str | None = None,
    seconds: float | None = None,
    batch_size: int = 1000,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete the rows of ``table`` past their retention, in batches; how many.

    ``seconds`` overrides the setting (``explicit_prune --older-than``). The ledger is
    refused below its floor (``LedgerBelowFloor``), whoever asks. Recorded in
    ``PruneRecord`` when the table is done.
    """
    alias = using or settings.database
    seconds = retention(table) if seconds is None else seconds
    if table == "ledger":
        refuse_below_floor(seconds)
    if not math.isfinite(seconds):
        return 0
    deleted = 0
    for query in _due(table, seconds, alias):
        while True:
            removed, selected = _delete_batch(query, batch_size, alias)
            deleted += removed
            if removed and progress is not None:
                progress(deleted)
            if selected < batch_size:
                break
    PruneRecord.objects.using(alias).update_or_create(
        table=table, defaults={"pruned_at": timezone.now(), "deleted": deleted}
    )
    return deleted


def _delete_batch(query: models.QuerySet[Any], batch_size: int, using: str) -> tuple[int, int]:
    """One batch in its own transaction: (rows deleted, rows selected)."""
    skip = bool(connections[using].features.has_select_for_update_skip_locked)
    with transaction.atomic(using=using):
        keys = list(
            query.select_for_update(skip_locked=skip).values_list("pk", flat=True)[:batch_size]
        )
        if not keys:
            return 0, 0
        # Locked above, so the rows are still the ones the condition chose.
        removed = query.model._base_manager.using(using).filter(pk__in=keys).delete()[0]
        return int(removed), len(keys)


# --- the ledger's floor -----------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One delay of the floor, and what set it."""

    seconds: float
    what: str


@dataclass(frozen=True)
class Floor:
    """The shortest ledger retention that still outlives every late copy of a job."""

    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return sum(term.seconds for term in self.terms)

    def describe(self) -> str:
        return " + ".join(f"{term.what} ({human(term.seconds)})" for term in self.terms)


class LedgerBelowFloor(ValueError):
    """``EXPLICIT_RETAIN_LEDGER`` is shorter than the floor: pruning would reopen
    duplicates. Carries the retention and the floor."""

    def __init__(self, seconds: float, floor: Floor) -> None:
        self.seconds, self.floor = seconds, floor
        super().__init__(
            f"{setting_name('ledger')}={seconds:g}s ({human(seconds)}) is shorter than the "
            f"ledger's floor of {floor.seconds:g}s ({human(floor.seconds)}): a copy of a job "
            f"can still arrive that late, and would find its ledger row gone and apply its "
            f"effect again. The floor is {floor.describe()}"
        )


def refuse_below_floor(seconds: float) -> None:
    floor = ledger_floor()
    if seconds < floor.seconds:
        raise LedgerBelowFloor(seconds, floor)


def ledger_floor(app: Any = None, tasks: Sequence[Any] | None = None) -> Floor:
    """The floor of the ledger's retention for ``app`` (default: the configured Celery
    app) and its ExplicitTasks (default: all of them, task modules imported)."""
    app = app if app is not None else settings.celery_app()
    tasks = list(tasks) if tasks is not None else _explicit_tasks(app)
    chain = [_backstop(app, tasks)]
    longest = max(tasks, key=lambda task: retry_schedule(task.contract), default=None)
    if longest is not None:
        chain.append(
            Term(
                retry_schedule(longest.contract),
                f"the retry schedule of task {longest.name} (max_attempts="
                f"{longest.contract.retry.max_attempts}, backoff_cap="
                f"{longest.contract.retry.backoff_cap:g}s, and its runs)",
            )
        )
    if settings.outbox_reconcile_after > 0:
        chain.append(Term(settings.outbox_reconcile_horizon, "EXPLICIT_OUTBOX_RECONCILE_HORIZON"))
    if settings.database_outage:
        chain.append(
            Term(settings.database_outage_backoff_cap, "EXPLICIT_DATABASE_OUTAGE_BACKOFF_CAP")
        )
    floor = Floor(tuple(term for term in chain if term.seconds > 0))
    deduped = [t for t in tasks if t.contract.dedup is not None]
    widest = max(deduped, key=lambda t: t.contract.dedup.window, default=None)
    if widest is not None and widest.contract.dedup.window > floor.seconds:
        return Floor((Term(widest.contract.dedup.window, f"dedup_window of task {widest.name}"),))
    return floor


def retry_schedule(contract: Any) -> float:
    """From a job's first try to its last: the ceilings of its backoff delays and the
    runs before them, each bounded by ``max_run_time`` or else by its lease."""
    policy = contract.retry
    retries = max(0, policy.max_attempts - 1)
    run = contract.max_run_time or contract.visibility_timeout
    delays = sum(
        retry_policy.backoff_ceiling(n, base=policy.backoff_base, cap=policy.backoff_cap)
        for n in range(1, retries + 1)
    )
    return float(delays + retries * run)


def _backstop(app: Any, tasks: Sequence[Any]) -> Term:
    url = str(app.conf.broker_url or "")
    if url.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://")):
        options = app.conf.broker_transport_options or {}
        timeout = float(options.get("visibility_timeout", REDIS_DEFAULT_VISIBILITY_TIMEOUT))
        sweep = float(options.get("unacked_restore_interval", REDIS_DEFAULT_SWEEP[0])) * float(
            options.get("unacked_restore_throttle", REDIS_DEFAULT_SWEEP[1])
        )
        return Term(
            timeout + sweep,
            f"the Redis broker's visibility_timeout ({timeout:g}s) and restore sweep "
            f"({sweep:g}s) in broker_transport_options",
        )
    if url.startswith(("amqp://", "amqps://", "pyamqp://")) and settings.rabbitmq_consumer_timeout:
        return Term(settings.rabbitmq_consumer_timeout, "EXPLICIT_RABBITMQ_CONSUMER_TIMEOUT")
    longest = max(tasks, key=lambda task: task.contract.visibility_timeout, default=None)
    if longest is None:
        return Term(0.0, "no task lease")
    return Term(
        longest.contract.visibility_timeout, f"the visibility_timeout of task {longest.name}"
    )


def _explicit_tasks(app: Any) -> list[Any]:
    """Every ExplicitTask of ``app``, its task modules imported (as the checks do:
    decorator-declared tasks exist only once the app finalizes)."""
    from celery_explicit.task import ExplicitTask

    worker_steps.import_tasks(app)
    return [task for task in app.tasks.values() if isinstance(task, ExplicitTask)]


def human(seconds: float) -> str:
    """``90330`` -> ``"1d 1h 5m 30s"``: how operators read retentions."""
    if not math.isfinite(seconds):
        return "forever"
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts) or f"{seconds:g}s"


# --- system checks ----------------------------------------------------------------------


@checks.register("django_outbox")
@reads_settings
def check_retention(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E020 the ledger's retention below its floor; W021 attempts or dead letters kept
    shorter than reconciliation's horizon (it would find no trace of a job that ran,
    and publish it again). A retention that is not a positive number is the settings
    check's (E006/E007)."""
    try:
        retentions = {table: retention(table) for table in TABLES}
    except (TypeError, ValueError):
        return []
    if not all(seconds > 0 for seconds in retentions.values()):
        return []
    found = _check_floor(retentions["ledger"])
    horizon = settings.outbox_reconcile_horizon
    if settings.outbox_reconcile_after > 0:
        for table in ("attempts", "dead_letters"):
            if retentions[table] < horizon:
                found.append(
                    checks.Warning(
                        f"{setting_name(table)}={retentions[table]:g}s is shorter than "
                        f"EXPLICIT_OUTBOX_RECONCILE_HORIZON={horizon:g}s: reconciliation "
                        "looks for a job's trace that long after its publish, and would "
                        "publish again a job whose trace was pruned",
                        hint=f"Keep {table} at least {human(horizon)}, or shorten the horizon.",
                        obj=setting_name(table),
                        id="django_outbox.W021",
                    )
                )
    return found


def _check_floor(seconds: float) -> list[checks.CheckMessage]:
    try:
        floor = ledger_floor()
    except (ImportError, ContractError):
        return []  # E004 / E001 report these
    if seconds >= floor.seconds:
        return []
    return [
        checks.Error(
            str(LedgerBelowFloor(seconds, floor)),
            hint=f"Set {setting_name('ledger')} to at least {math.ceil(floor.seconds)} "
            f"({human(floor.seconds)}), or shorten what sets the floor.",
            obj=setting_name("ledger"),
            id="django_outbox.E020",
        )
    ]


@checks.register("django_outbox", checks.Tags.database)
@reads_settings
def check_pruned(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W020 (``check --database default``): rows are past their retention and nothing
    has pruned for longer than the shortest retention."""
    alias = settings.database
    if alias not in (kwargs.get("databases") or ()):
        return []
    try:
        retentions = {table: retention(table) for table in TABLES}
    except (TypeError, ValueError):
        return []  # the settings check reports it (E007)
    kept = {table: s for table, s in retentions.items() if math.isfinite(s) and s > 0}
    if not kept:
        return []
    shortest = min(kept.values())
    try:
        last = PruneRecord.objects.using(alias).aggregate(last=Max("pruned_at"))["last"]
        if last is not None and last > timezone.now() - timedelta(seconds=shortest):
            return []
        waiting = [t for t, s in kept.items() if _any_due(t, s, alias)]
    except DatabaseError:
        return []  # no table yet (before migrate)
    if not waiting:
        return []
    since = "nothing has ever pruned them" if last is None else f"the last prune was {last}"
    return [
        checks.Warning(
            f"rows of {', '.join(waiting)} are past their retention and {since}: "
            f"nothing has pruned for longer than the shortest retention "
            f"({human(shortest)}), and the tables grow without end",
            hint="Run manage.py explicit_prune from cron (daily or more often).",
            id="django_outbox.W020",
        )
    ]


def _any_due(table: str, seconds: float, using: str) -> bool:
    return any(query.exists() for query in _due(table, seconds, using))


def tables(names: Iterable[str] | None) -> list[str]:
    """``names`` in pruning order (all tables when None)."""
    chosen = set(names or TABLES)
    return [table for table in TABLES if table in chosen]
