"""Each task's idempotency key templates, as workers started with them.

The store side of ``celery_explicit.key_history``: a worker records its tasks'
templates at start, and a template it has not seen before beside an older one of the
same task is a rename, warned about at start and shown by ``manage.py check
--database default`` (``django_outbox.W010``). The job path reads the earlier
templates once per process, to check an effect under every name it had.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from celery_explicit.outcomes import Outcome
from celery_explicit.store import Rename
from django_outbox.conf import settings
from django_outbox.models import Attempt, KeyTemplate

#: A job whose last attempt scheduled a retry within this long is counted in flight.
IN_FLIGHT_HORIZON = dt.timedelta(days=1)


def earlier(task_name: str, current: str) -> list[str]:
    """The task's recorded templates other than ``current``, most recent first."""
    return list(
        KeyTemplate.objects.using(settings.database)
        .filter(task_name=task_name)
        .exclude(template=current)
        .order_by("-last_seen")
        .values_list("template", flat=True)
    )


def record(current: Mapping[str, str]) -> list[Rename]:
    """Record each task's template; the renames: tasks whose template is new and that
    had another one, the most recently seen."""
    now = timezone.now()
    renames = []
    alias = settings.database
    with transaction.atomic(using=alias):
        rows = KeyTemplate.objects.using(alias).filter(task_name__in=list(current))
        known: dict[str, list[KeyTemplate]] = {}
        for row in rows.order_by("-last_seen"):
            known.setdefault(row.task_name, []).append(row)
        for task_name, template in sorted(current.items()):
            seen = known.get(task_name, [])
            if seen and all(row.template != template for row in seen):
                renames.append(Rename(task_name, seen[0].template, template, in_flight(task_name)))
            KeyTemplate.objects.using(alias).update_or_create(
                task_name=task_name,
                template=template,
                defaults={"last_seen": now},
                create_defaults={"first_seen": now, "last_seen": now},
            )
    return renames


def in_flight(task_name: str) -> int:
    """Jobs of the task whose last attempt scheduled a retry (in the last day)."""
    later = Attempt.objects.filter(
        task_id=OuterRef("task_id"), started_at__gt=OuterRef("started_at")
    )
    return (
        Attempt.objects.using(settings.database)
        .filter(
            task_name=task_name,
            outcome=Outcome.RETRY_SCHEDULED,
            started_at__gte=timezone.now() - IN_FLIGHT_HORIZON,
        )
        .filter(~Exists(later))
        .values("task_id")
        .distinct()
        .count()
    )


def renamed() -> list[Rename]:
    """Every task with more than one recorded template: its two most recent."""
    by_task: dict[str, list[str]] = {}
    for row in KeyTemplate.objects.using(settings.database).order_by("task_name", "-last_seen"):
        by_task.setdefault(row.task_name, []).append(row.template)
    return [
        Rename(task, templates[1], templates[0], in_flight(task))
        for task, templates in by_task.items()
        if len(templates) > 1
    ]
