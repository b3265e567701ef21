"""The prune: which rows of each table are past their retention, and how they go.

- **attempts** by ``started_at``; **fences** by ``taken_over_at``;
- **dead letters** resolved (replayed or discarded) by ``resolved_at``. An open dead
  letter is never pruned, however old: it is the evidence of a job nobody looked at;
- **outbox events** published by ``published_at``, once reconciliation is done with
  them (``django_outbox.outbox.relay.reconcile``: a worker's trace was found,
  ``checked_at`` set, or they are past ``EXPLICIT_OUTBOX_RECONCILE_HORIZON``, which it
  never looks beyond); dead-lettered and deduplicated events by ``created_at``. A
  pending event is never pruned, nor a published one the reconciler may still
  republish;
- **the ledger** by ``processed_at``, never below its floor (``retention.floor``);
- **cancellations** by ``requested_at``.

Each table is pruned in batches: one short transaction selects up to ``batch_size``
due primary keys along an index (``FOR UPDATE SKIP LOCKED``: a row a worker, the relay
or the reconciler holds is left for the next run, and the lock keeps its row from
changing until the delete) and deletes them by key. Nothing is held between batches,
so a prune runs beside the workers, and a prune that is killed is run again: it starts
over from what is left. The cutoffs are the database's clock (``now()``), as the
reconciler's are. Attempts are selected per outcome along ``(outcome, started_at)``,
the index the admin already keeps, so retention adds no index to the table every job
writes. Each finished table is recorded in ``PruneRecord`` (check W020 reads it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db import connections, models, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from django_outbox.conf import settings
from django_outbox.models import (
    Attempt,
    Cancellation,
    DeadLetter,
    DeadLetterStatus,
    Fence,
    OutboxEvent,
    OutboxStatus,
    Outcome,
    ProcessedOperation,
    PruneRecord,
)
from django_outbox.retention.floor import refuse_below_floor
from django_outbox.retention.periods import TABLES, retention

__all__ = ["any_due", "count", "prune", "reconciled"]


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
    if table == "cancellations":
        # An operator's decision: a few rows, scanned whole.
        return [Cancellation.objects.using(using).filter(requested_at__lt=cutoff).order_by("pk")]
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


def any_due(table: str, seconds: float, using: str) -> bool:
    return any(query.exists() for query in _due(table, seconds, using))
