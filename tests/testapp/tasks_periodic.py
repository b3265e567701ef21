"""Periodic tasks the beat tests run (tests/fault/test_periodic.py)."""

from __future__ import annotations

from celery_explicit import ExplicitTask
from tests.celery_app import app


class SlotReport(ExplicitTask):
    """Notes each run's slot in ``slots:<tag>`` (a Redis list): one item per message a
    beat published."""

    name = "tests.slot_report"
    periodic = True
    idempotency_key = "slotreport:{tag}:{slot}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, tag: str, slot: str) -> None:
        from celery_explicit import redis_state

        redis_state.client().rpush(f"slots:{tag}", slot)


app.register_task(SlotReport())
