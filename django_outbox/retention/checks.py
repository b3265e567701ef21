"""Retention's checks, beside the prune they guard.

- E020 the ledger's retention is below its floor (``retention.floor``): pruning would
  reopen duplicates, and ``explicit_prune`` refuses to
- W021 attempts or dead letters kept shorter than reconciliation's horizon: it would
  find no trace of a job that ran, and publish it again
- W020 (``check --database default``) rows are past their retention and nothing has
  pruned for longer than the shortest retention
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.db import DatabaseError
from django.db.models import Max
from django.utils import timezone

from celery_explicit.errors import ContractError
from django_outbox.checks import reads_settings
from django_outbox.conf import settings
from django_outbox.models import PruneRecord
from django_outbox.retention.floor import LedgerBelowFloor, ledger_floor
from django_outbox.retention.periods import TABLES, human, retention, setting_name
from django_outbox.retention.pruning import any_due

__all__ = ["check_pruned", "check_retention"]


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
        waiting = [t for t, s in kept.items() if any_due(t, s, alias)]
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
