"""The same one-row update, as a plain acks_late Celery task and as an ExplicitTask."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from bench.benchapp.models import Row
from bench.celery_app import app
from celery_explicit import ExplicitTask


@app.task(name="bench.plain_update", acks_late=True)
def plain_update(row_id: int, op_id: str) -> None:
    with transaction.atomic():
        Row.objects.filter(id=row_id).update(value=F("value") + 1)


class ExplicitUpdate(ExplicitTask):
    name = "bench.explicit_update"
    idempotency_key = "bench:{op_id}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, row_id: int, op_id: str) -> None:
        with self.effect() as eff:
            if eff.done:
                return
            Row.objects.filter(id=row_id).update(value=F("value") + 1)


app.register_task(ExplicitUpdate())


@app.task(name="bench.noop", acks_late=True)
def noop(row_id: int, op_id: str) -> None:
    """Baseline: Celery's own cost per task on this machine."""
