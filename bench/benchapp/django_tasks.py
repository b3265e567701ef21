"""The bench's one-row update as a ``django.tasks`` function (Django 6.1+ only:
imported by bench/django_tasks_cost.py, never by the worker on an older Django)."""

from __future__ import annotations

from django.db.models import F
from django.tasks import task

from bench.benchapp.models import Row
from celery_explicit import effect


@task(
    idempotency_key="bench-dt:{op_id}",
    visibility_timeout=30,
    expected_duration=1,
    retry_on=(),
    fail_on=(),
)
def update_row(row_id: int, op_id: str) -> None:
    with effect() as eff:
        if eff.done:
            return
        Row.objects.filter(id=row_id).update(value=F("value") + 1)
