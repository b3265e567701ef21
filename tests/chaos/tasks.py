"""The chaos workload's tasks: each writes its effect row inside its effect, so the
history says exactly how many times each job's effect was applied."""

from __future__ import annotations

import os
import time

from celery_explicit import ExplicitTask
from tests.celery_app import app
from tests.chaos import history


class Transient(Exception):
    pass


class Poison(Exception):
    """A permanent error: no retry can fix it."""


class ChaosJob(ExplicitTask):
    """One job of the workload. ``hold`` keeps it running (a window for faults);
    ``poison``: "permanent" raises a declared permanent error, "crash" kills its own
    process (``os._exit``) before the effect."""

    name = "chaos.job"
    idempotency_key = "chaos:{run}:{job}"
    visibility_timeout = 6
    expected_duration = 1
    retry_on = (Transient,)
    fail_on = (Poison,)
    max_deliveries = 3
    backoff_base = 0.2
    backoff_cap = 2.0

    def run(
        self, run: str, job: int, hold: float = 0.0, poison: str = "", after: float = 0.0
    ) -> None:
        if poison == "permanent":
            raise Poison(f"job {job} of run {run} can never succeed")
        if poison == "crash":
            os._exit(1)
        if hold:
            time.sleep(hold)
        with self.effect() as effect:
            if effect.done:
                return  # applied before (a redelivery after the commit): nothing to do
            history.record_effect(run, job, os.getpid())
        if after:
            time.sleep(after)  # committed, not yet acknowledged


@app.task(name="chaos.job_unguarded", acks_late=True, reject_on_worker_lost=True)
def chaos_job_unguarded(
    run: str, job: int, hold: float = 0.0, poison: str = "", after: float = 0.0
) -> None:
    """The negative control: the same effect without the ledger (what a plain
    acks_late task does on a redelivery: apply again)."""
    if hold:
        time.sleep(hold)
    history.record_effect(run, job, os.getpid())
    if after:
        time.sleep(after)


app.register_task(ChaosJob())
# The scenarios' own tasks, registered with the same app:
# the worker imports this module through tests/testapp/tasks.py.
from tests.chaos import tasks_deploys, tasks_postgres, tasks_retry_storm  # noqa: E402, F401


class ChaosJobUnlimited(ChaosJob):
    """The poison messages' negative control: no delivery limit to speak of (a crasher loops)."""

    name = "chaos.job_unlimited"
    max_deliveries = 10_000


app.register_task(ChaosJobUnlimited())
from tests.chaos import tasks_hosts  # noqa: E402, F401
