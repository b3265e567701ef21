"""The PostgreSQL restarts' task: the chaos job, with a lost database connection
declared transient.

A PostgreSQL restart reaches the handler as ``OperationalError`` (the server went away
mid-transaction, or refused the connection) or ``InterfaceError`` (Django's connection
was already closed). Both say "try again later", which is what an application calling a
database that restarts would declare; whether its effect committed is the ledger's to
say on the retry.
"""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

from tests.celery_app import app
from tests.chaos.tasks import ChaosJob, Transient


class ChaosDbJob(ChaosJob):
    name = "chaos.db_job"
    retry_on = (Transient, OperationalError, InterfaceError)
    # A restart takes the server away for a second or two: backoff 0.5, 1, 2, 4, 4...
    # outlasts several in a row before the attempts run out.
    max_attempts = 10
    backoff_base = 0.5
    backoff_cap = 4.0


app.register_task(ChaosDbJob())
