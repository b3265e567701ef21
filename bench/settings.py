"""Benchmark settings: the test settings on a database of their own, plus the bench app."""

import os

os.environ.setdefault("EXPLICIT_TEST_DB_NAME", "explicit_bench")

from tests.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "bench.benchapp"]  # noqa: F405
CELERY_BROKER_URL = os.environ.get("EXPLICIT_BENCH_BROKER_URL", "redis://127.0.0.1:6379/14")
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
EXPLICIT_CELERY_APP = "bench.celery_app.app"
# Persistent connections: a worker opening a PostgreSQL connection per task measures
# connection set-up, not the task (Celery's Django fixup closes them after each task
# when CONN_MAX_AGE is 0).
DATABASES["default"]["CONN_MAX_AGE"] = 600  # noqa: F405
CELERY_DB_REUSE_MAX = 1000
# EXPLICIT_BENCH_RELAY_ROUND_TRIPS=0: the relay's statements through Django's cursor (the
# A/B of docs/performance.md, for relay_throughput.py and outbox_lag.py's relay alike).
EXPLICIT_OUTBOX_RELAY_ROUND_TRIPS = os.environ.get("EXPLICIT_BENCH_RELAY_ROUND_TRIPS", "1") != "0"
