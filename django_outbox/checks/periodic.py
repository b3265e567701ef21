"""The periodic checks: W015, a periodic task whose key does not name its slot; W016, a
slot of a periodic entry that no beat published.

- W015: a task that declares ``periodic = True``, or an ExplicitTask an entry of
  ``beat_schedule`` runs, whose idempotency key does not use ``{slot}``: every run
  renders the key the first one did, so each run after the first finds its effect
  already applied and does nothing.
- W016 (``check --database <alias>``, as Django's own database checks): the slots due
  in the last day, from each entry's first published slot until two minutes ago, that
  no beat published (``django_outbox.store.periodic_slots``): every beat was down or
  stopped across them. Celery's beat never says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks

from celery_explicit import periodic
from celery_explicit.errors import ContractError
from django_outbox.checks.reading import loaded_tasks, reads_settings
from django_outbox.conf import settings

__all__ = ["check_missed_slots", "check_periodic_keys"]

#: Slots named in one W016 message; the rest are counted.
SHOWN_SLOTS = 5


@checks.register("django_outbox")
@reads_settings
def check_periodic_keys(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    try:
        app = settings.celery_app()
        tasks = loaded_tasks(app)
    except (ImportError, ContractError):
        return []  # E004 / E001 say so
    scheduled = {
        str(entry.get("task")) for entry in (app.conf.beat_schedule or {}).values() if entry
    }
    found: list[checks.CheckMessage] = []
    for task in tasks:
        contract = task.contract
        if not (contract.periodic or task.name in scheduled):
            continue
        if periodic.key_uses_slot(contract.idempotency_key):
            continue
        why = "declares periodic = True" if contract.periodic else "is run by beat_schedule"
        found.append(
            checks.Warning(
                f"task {task.name} {why}, but its idempotency_key "
                f"{contract.idempotency_key!r} does not use the schedule slot: every run "
                "renders the same key, so each run after the first finds its effect "
                "already applied and does nothing",
                hint="Key the effect by its slot: declare periodic = True, take run(self, "
                "slot: str, ...) and write {slot} in the key (e.g. idempotency_key = "
                "'report:{slot}'); see docs/howto/periodic.md.",
                obj=task.name,
                id="django_outbox.W015",
            )
        )
    return found


@checks.register("django_outbox", checks.Tags.database)
@reads_settings
def check_missed_slots(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    from django.db import DatabaseError

    from django_outbox.store import periodic_slots

    if settings.database not in (kwargs.get("databases") or ()):
        return []
    try:
        gaps = periodic_slots.missing()
    except DatabaseError:
        return []  # no table yet (before migrate): the migration check says so
    return [
        checks.Warning(
            f"periodic entry {gap.entry!r} ({gap.task_name}, {gap.grid}): "
            f"{len(gap.slots)} slot(s) in the last day were never published: "
            + ", ".join(periodic.format_slot(slot) for slot in gap.slots[:SHOWN_SLOTS])
            + (f" and {len(gap.slots) - SHOWN_SLOTS} more" if len(gap.slots) > SHOWN_SLOTS else "")
            + (
                f"; last published {periodic.format_slot(gap.last_published)}"
                if gap.last_published
                else ""
            ),
            hint="No beat ran across those slots (stopped, crashed, or not started with "
            "-S celery_explicit.beat:PersistentScheduler). Beat does not run missed slots; "
            "publish one by hand with its slot if its effect is needed: "
            "task.apply_async(kwargs={'slot': '<slot>'}).",
            obj=gap.entry,
            id="django_outbox.W016",
        )
        for gap in gaps
    ]
