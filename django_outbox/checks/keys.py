"""The key check: W010, a task whose idempotency key template changed (a rename).

A worker records each task's key template as it starts (``store.key_history``); a
renamed template still finds the effects applied under the old one, and this check
says so, with the jobs still in flight under the old key. It reads the database, so
only ``check --database <alias>`` runs it (as Django's own database checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks

from celery_explicit.errors import ContractError
from django_outbox.checks.reading import loaded_tasks, reads_settings
from django_outbox.conf import settings

__all__ = ["check_key_renames"]


@checks.register("django_outbox", checks.Tags.database)
@reads_settings
def check_key_renames(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W010: a task whose recorded key templates differ (a rename). Reads the
    database, so only ``check --database <alias>`` runs it (as Django's own)."""
    from django.db import DatabaseError

    from django_outbox.store import key_history

    if settings.database not in (kwargs.get("databases") or ()):
        return []
    try:
        current = {
            t.name: t.contract.idempotency_key
            for t in loaded_tasks(settings.celery_app())
            if isinstance(t.contract.idempotency_key, str)
        }
        recorded = key_history.renamed()
    except (DatabaseError, ImportError, ContractError):
        return []  # no table yet (before migrate), no app, a bad task: others say so
    found: list[checks.CheckMessage] = []
    for rename in recorded:
        now = current.get(rename.task_name)
        if now is None:
            continue
        # The most recent template other than the one the code declares now.
        old = rename.old if now == rename.new else rename.new
        found.append(
            checks.Warning(
                f"task {rename.task_name}: idempotency_key was {old!r} and is now {now!r}. "
                f"An effect applied under either is found under both, and recorded under "
                f"both when applied; {rename.in_flight} job(s) with a retry pending were "
                "published under the old one",
                hint="Nothing to do for a rename (celery_explicit.key_history); a template "
                "that names another effect needs a new task name instead.",
                obj=rename.task_name,
                id="django_outbox.W010",
            )
        )
    return found
