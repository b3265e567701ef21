"""``effect()``: the business effect and its ledger row in one transaction.

The handler's tool against a second effect: the key of record (rendered when the
execution began) is claimed in the effect's own transaction by the store's ledger
(``django_outbox.store.ledger``), so a redelivery, a retry or a concurrent worker with the
same key is told ``done`` instead of applying it again; a paused execution whose lease
was taken over has its commit refused by the fence. The attempt row joins the same
commit, so ``applied`` is recorded exactly when the effect committed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connections

from celery_explicit import metrics, records, store
from celery_explicit.conf import settings
from celery_explicit.execution import current
from celery_explicit.outcomes import Outcome
from celery_explicit.store import Effect, Statement


@contextmanager
def effect_of(task: Any, *, using: str | None = None) -> Iterator[Effect]:
    """``task.effect()``: see the module docstring."""
    execution = current(task.request, task.name)
    request = task.request
    ledger = store.get()
    alias = using or settings.database
    # The attempt row joins the effect's commit only when that commit is the
    # effect's own and on the audit database; inside a caller's atomic() an outer
    # rollback could take it away, so it is then written when the attempt ends.
    joins_commit = (
        execution.audited and alias == settings.database and not connections[alias].in_atomic_block
    )

    commit_started: list[float] = []

    def attempt_row(claimed: Effect) -> list[Statement]:
        # Runs inside the effect's transaction, after the block: the attempt row
        # commits with the effect (one commit per job), and "applied" is never
        # recorded for an effect that rolled back.
        commit_started.append(time.perf_counter())
        execution.outcome = Outcome.ALREADY_APPLIED if claimed.done else Outcome.APPLIED
        if not joins_commit:
            return []
        fields = records.fields_of(execution, request, execution.outcome)
        return [ledger.attempt_statement(fields, replace=execution.effect_row_written)]

    try:
        with ledger.effect(
            key=execution.key,
            fingerprint=execution.fingerprint,
            task_name=task.name,
            task_id=execution.task_id,
            using=using,
            before_commit=attempt_row,
            fence=execution.fence,
            cancellable=task.contract.cancellable,
            other_keys=execution.other_keys,
            accepted_fingerprints=execution.accepted_fingerprints,
        ) as claimed:
            yield claimed
    except BaseException:
        execution.outcome = None  # rolled back: the error path records the attempt
        raise
    if commit_started:
        # The ledger's last writes and COMMIT, for the attempt's log line.
        execution.timings["commit"] = (time.perf_counter() - commit_started[0]) * 1000.0
    if joins_commit:
        execution.effect_row_written = execution.recorded = True
        assert execution.outcome is not None
        # Its metric and log line when the handler has ended (the line then has the
        # handler's whole time); a handler that fails after the commit logs the
        # failure instead.
        execution.line_pending = True
    if claimed.done:
        metrics.idempotency_conflicts.labels(task.name, "duplicate").inc()
        records.log("effect already applied: duplicate absorbed", execution, layer="effect")
    else:
        metrics.effects_applied.labels(task.name).inc()
