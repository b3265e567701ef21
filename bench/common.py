"""Shared set-up for the benchmarks: Django on the bench database, migrated, empty."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
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


class ProcessCPU:
    """CPU seconds (user + system) spent so far by each part of an end-to-end run, read
    from /proc (Linux): this process (the publisher), a worker's main process, its pool
    children, the PostgreSQL server and the Redis server.

    PostgreSQL's backends come and go (Celery's Django fixup reconnects every
    ``CELERY_DB_REUSE_MAX`` tasks), so the server is counted as the postmaster with the
    CPU of its exited children (``cutime``/``cstime``) plus each live child: a backend
    that exits between two readings moves from the one to the other.
    """

    PARTS = ("publisher", "worker main", "pool children", "postgres", "redis")

    def __init__(self, worker_pid: int) -> None:
        self.worker_pid = worker_pid
        self.tick = os.sysconf("SC_CLK_TCK")
        self.postmaster = _oldest("postgres")
        self.redis = _oldest("redis-server")

    def read(self) -> dict[str, float]:
        return {
            "publisher": time.process_time(),
            "worker main": self._own(self.worker_pid),
            "pool children": sum(map(self._own, _children(self.worker_pid))),
            "postgres": self._own(self.postmaster, reaped=True)
            + sum(map(self._own, _children(self.postmaster))),
            "redis": self._own(self.redis, reaped=True) if self.redis else 0.0,
        }

    def _own(self, pid: int, *, reaped: bool = False) -> float:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            return 0.0  # exited between the listing and the read
        # utime, stime (and cutime, cstime): fields 14-17 of proc(5), after the name.
        ticks = int(fields[11]) + int(fields[12])
        if reaped:
            ticks += int(fields[13]) + int(fields[14])
        return ticks / self.tick


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except FileNotFoundError:
        return []


def _oldest(name: str) -> int:
    """The first process of that name (pgrep -o): the postmaster, the Redis server."""
    out = subprocess.run(["pgrep", "-o", "-x", name], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out.split() else 0


def summary(name: str, rates: list[float]) -> str:
    return (
        f"{name:<34} median {statistics.median(rates):9.1f}/s   "
        f"min {min(rates):9.1f}/s   max {max(rates):9.1f}/s   (n={len(rates)})"
    )
