"""Tasks of the redaction test (tests/integration/test_redaction_paths.py): one that
declares its card sensitive, and the same without the declaration as the control.

``mode`` picks the path: "" succeeds, "transient" quotes the card in a retryable error
until its attempts run out, "declined" quotes it in a permanent one, "hang" ignores
the soft time limit until the hard one kills it. Their results are kept (the test's
worker has a result backend), with their arguments when the worker says so.
"""

from __future__ import annotations

import os
import time

from celery.exceptions import SoftTimeLimitExceeded

from celery_explicit import ExplicitTask
from tests.celery_app import app

if os.environ.get("EXPLICIT_TEST_RESULT_EXTENDED") == "1":
    app.conf.result_extended = True
    # The STARTED state is stored, with the request's arguments, before the handler.
    app.conf.task_track_started = True


class GatewayTimeout(Exception):
    pass


class CardRefused(Exception):
    pass


class ChargeCard(ExplicitTask):
    name = "tests.redaction.charge"
    idempotency_key = "charge:{ref}"
    visibility_timeout = 30
    expected_duration = 1
    max_run_time = 1
    retry_on = (GatewayTimeout,)
    fail_on = (CardRefused,)
    max_attempts = 2
    backoff_base = 0.01
    backoff_cap = 0.05
    ignore_result = False
    sensitive = ("card",)

    def run(self, ref: str, card: str, mode: str = "") -> str:
        if mode == "transient":
            raise GatewayTimeout(f"gateway timed out charging card {card}")
        if mode == "declined":
            raise CardRefused(f"card {card} declined")
        if mode == "hang":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    time.sleep(0.1)
                except SoftTimeLimitExceeded:
                    continue  # ignores the soft limit: the hard one kills it
        return f"charged {ref}"


class ChargeCardPlain(ChargeCard):
    """The control: the same task, nothing declared sensitive."""

    name = "tests.redaction.charge_plain"
    idempotency_key = "charge_plain:{ref}"
    sensitive = ()


app.register_task(ChargeCard())
app.register_task(ChargeCardPlain())
