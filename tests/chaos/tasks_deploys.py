"""The rolling deploys' task: a chaos job that counts its handler's starts (a deploy
must not start a running job a second time) and runs longer than its lease."""

from __future__ import annotations

import os
import time

from celery_explicit import ExplicitTask, redis_state
from tests.celery_app import app
from tests.chaos import history


def starts_key(run: str, job: int) -> str:
    return f"chaos:starts:{run}:{job}"


class DeployJob(ExplicitTask):
    """Runs ``hold`` seconds before its effect, more than its 3 s lease for most jobs:
    only the heartbeat (and, in a warm shutdown, the drain's) keeps it."""

    name = "chaos.deploy_job"
    idempotency_key = "chaos:{run}:{job}"
    visibility_timeout = 3
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, run: str, job: int, hold: float = 0.0) -> None:
        client = redis_state.client()
        key = starts_key(run, job)
        client.incr(key)
        client.expire(key, 3600)
        time.sleep(hold)
        with self.effect() as effect:
            if not effect.done:
                history.record_effect(run, job, os.getpid())


app.register_task(DeployJob())
