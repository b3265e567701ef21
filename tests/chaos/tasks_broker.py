"""The job of the broker scenarios (R2, R5): ``ChaosJob`` whose body honours the
ledger's answer. ``ChaosJob.run`` writes its effect row even when ``effect.done`` says
the key was applied already, so every redelivery the ledger absorbs is still counted as
a duplicate effect; broker restarts redeliver (a worker's unacked messages come back).
Once ``ChaosJob.run`` returns on ``effect.done``, this module can go."""

from __future__ import annotations

import os

from tests.celery_app import app
from tests.chaos import history
from tests.chaos.tasks import ChaosJob


class BrokerJob(ChaosJob):
    name = "chaos.broker_job"

    def run(
        self, run: str, job: int, hold: float = 0.0, poison: str = "", after: float = 0.0
    ) -> None:
        with self.effect() as effect:
            if effect.done:
                return
            history.record_effect(run, job, os.getpid())


app.register_task(BrokerJob())
