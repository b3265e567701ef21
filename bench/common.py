"""Shared set-up for the benchmarks: Django on the bench database, migrated, empty."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = os.environ.get("EXPLICIT_BENCH_DB", "explicit_bench")


def setup_django() -> None:
    os.environ["EXPLICIT_TEST_DB_NAME"] = DB_NAME
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    subprocess.run(
        ["createdb", "-h", "127.0.0.1", "-U", "postgres", DB_NAME], capture_output=True, check=False
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    vacuum()


def vacuum() -> None:
    """VACUUM ANALYZE the bench database before measuring.

    Every run inserts, updates and deletes thousands of rows; where autovacuum is off
    (it is on the development machine: ``SHOW autovacuum``) or behind, the dead tuples
    pile up across runs in the indexes the measured statements use (1.25 million in
    the outbox table once: an empty claim took 7.4 ms instead of 0.18 ms), and a run
    measures the previous runs' garbage rather than the code.
    """
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")


def reset_rows() -> None:
    """The 100 rows the benchmarks update, at zero; no ledger or attempt rows; vacuumed."""
    from bench.benchapp.models import Row
    from django_outbox.models import Attempt, ProcessedOperation

    Row.objects.all().delete()
    ProcessedOperation.objects.all().delete()
    Attempt.objects.all().delete()
    Row.objects.bulk_create(Row(id=i) for i in range(100))
    vacuum()


def start_worker(queue: str, *more: str) -> subprocess.Popen[bytes]:
    """A ``celery worker`` of the bench app on ``queue`` (prefork ``-c 2``, WARNING, no
    gossip, mingle or heartbeat), its output discarded; ``more``: further options
    before ``-Q`` (``-I module``). WARNING level prints no "ready": the caller waits."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "EXPLICIT_TEST_DB_NAME": DB_NAME,
        "PYTHONPATH": str(ROOT),
    }
    # fmt: off
    command = [
        sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", *more,
        "-Q", queue, "-c", "2", "-P", "prefork", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "WARNING",
    ]
    # fmt: on
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )


def summary(name: str, rates: list[float]) -> str:
    return (
        f"{name:<34} median {statistics.median(rates):9.1f}/s   "
        f"min {min(rates):9.1f}/s   max {max(rates):9.1f}/s   (n={len(rates)})"
    )
