"""Shared set-up for the benchmarks: Django on the bench database, migrated, empty."""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

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
    (``SHOW autovacuum``) or behind, the dead tuples pile up across runs in the indexes
    the measured statements use (1.25 million in the outbox table made an empty claim
    take 7.4 ms instead of 0.18 ms), and a run measures the previous runs' garbage
    rather than the code.
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


def raw_connection() -> Any:
    """The bench database's psycopg connection, in autocommit, with the rows reset: for
    statements sent through libpq by hand (effect_ceiling.py, effect_protocol.py)."""
    from django.db import connection

    reset_rows()
    connection.ensure_connection()
    raw = connection.connection
    raw.autocommit = True
    return raw


def pool_child_jobs(hostname: str) -> dict[str, Callable[[int], Any]]:
    """The plain task, the floor and the ExplicitTask, each run in this process through
    Celery's tracer (``task.apply()``), with this process made to stand for a prefork
    pool child: Celery's ``setup_worker_optimizations`` (the worker's main process runs
    it before it forks), then ``worker_process_init`` as billiard's child sends it
    (``EXPLICIT_BENCH_POOL_CHILD=0`` leaves it out). The rows are reset first."""
    from celery import signals
    from celery.app import trace

    from bench.benchapp.tasks import ExplicitUpdate, floor_update, plain_update

    trace.setup_worker_optimizations(plain_update.app, hostname)
    if os.environ.get("EXPLICIT_BENCH_POOL_CHILD", "1") != "0":
        signals.worker_process_init.send(sender=None)
    reset_rows()
    explicit = ExplicitUpdate()
    return {
        "plain": lambda i: plain_update.apply(args=[i % 100, uuid.uuid4().hex]),
        "floor": lambda i: floor_update.apply(args=[i % 100, uuid.uuid4().hex]),
        "explicit": lambda i: explicit.apply(args=[i % 100, uuid.uuid4().hex]),
    }


def start_worker(
    queue: str, *more: str, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A ``celery worker`` of the bench app on ``queue`` (prefork ``-c 2``, WARNING, no
    gossip, mingle or heartbeat), its output kept for ``check_workers``; ``more``: further options
    before ``-Q`` (``-I module``); ``extra_env``: further environment variables. WARNING
    level prints no "ready": the caller waits."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "EXPLICIT_TEST_DB_NAME": DB_NAME,
        "PYTHONPATH": str(ROOT),
        **(extra_env or {}),
    }
    # fmt: off
    command = [
        sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", *more,
        "-Q", queue, "-c", "2", "-P", "prefork", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "WARNING",
    ]
    # fmt: on
    with tempfile.NamedTemporaryFile(prefix="bench-worker-", suffix=".log", delete=False) as log:
        worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    _worker_logs[worker.pid] = Path(log.name)
    return worker


#: Each started worker's output, by pid: read by check_workers once it has stopped.
_worker_logs: dict[int, Path] = {}


def check_workers(*workers: subprocess.Popen[bytes]) -> None:
    """Exit with the worker's errors when any job of a stopped worker failed: a
    benchmark whose jobs raise measures Celery's failure path, not the job, and its
    rounds still complete (a job that raises after its commit still moves the rows the
    benchmark counts)."""
    failed = []
    for worker in workers:
        log = _worker_logs.pop(worker.pid, None)
        if log is None:
            continue
        text = log.read_text(errors="replace")
        log.unlink()
        lines = text.splitlines()
        bad = [i for i, line in enumerate(lines) if " ERROR/" in line or "CRITICAL/" in line]
        if bad:
            failed.append("\n".join(lines[bad[0] : bad[0] + 40]))
    if failed:
        raise SystemExit("a bench worker logged errors:\n" + "\n---\n".join(failed))


class ProcessCPU:
    """CPU seconds (user + system) spent so far by each part of an end-to-end run, read
    from /proc (Linux): this process (the publisher), a worker's main process, its pool
    children, the PostgreSQL server and the Redis server the bench talks to.

    The servers are counted whole (every client of theirs and their background work,
    this process's polling included), so run nothing else against them meanwhile.
    PostgreSQL's backends come and go (Celery's Django fixup reconnects every
    ``CELERY_DB_REUSE_MAX`` tasks), so it is counted as the postmaster with the CPU of
    its exited children (``cutime``/``cstime``) plus each live child: a backend that
    exits between two readings moves from the one to the other.
    """

    PARTS = ("publisher", "worker main", "pool children", "postgres", "redis")

    def __init__(self, worker_pid: int, redis_url: str) -> None:
        import redis
        from django.db import connection

        self.worker_pid = worker_pid
        self.tick = os.sysconf("SC_CLK_TCK")
        # Asked of the servers themselves: the machine may run other PostgreSQL and
        # Redis servers (the test suite starts private ones).
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend = cursor.fetchone()[0]
        self.postmaster = _stat(backend)[1]  # a backend's parent is the postmaster
        self.redis = int(redis.Redis.from_url(redis_url).info("server")["process_id"])

    def read(self) -> dict[str, float]:
        return {
            "publisher": time.process_time(),
            "worker main": self._own(self.worker_pid),
            "pool children": sum(map(self._own, _children(self.worker_pid))),
            "postgres": self._own(self.postmaster, reaped=True)
            + sum(map(self._own, _children(self.postmaster))),
            "redis": self._own(self.redis, reaped=True),
        }

    def _own(self, pid: int, *, reaped: bool = False) -> float:
        try:
            fields = _stat(pid)
        except FileNotFoundError:
            return 0.0  # a child that exited between the listing and the read
        # proc(5): utime and stime are fields 14 and 15, cutime and cstime 16 and 17;
        # _stat starts its list at field 3.
        ticks = fields[11] + fields[12]
        if reaped:
            ticks += fields[13] + fields[14]
        return ticks / self.tick


def _stat(pid: int) -> list[int]:
    """/proc/PID/stat from its field 3 (state) on, the numbers as ints (state as 0)."""
    with open(f"/proc/{pid}/stat") as stat:
        rest = stat.read().rsplit(")", 1)[1].split()
    return [0] + [int(field) for field in rest[1:]]


def _children(pid: int) -> list[int]:
    """The children of ``pid``'s main thread (both the worker and the postmaster fork
    from theirs). Missing only on kernels without CONFIG_PROC_CHILDREN: refused, since
    the counts would read 0."""
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


def per_round(ratios: list[float]) -> str:
    """Each round's ratio, as the benchmarks print them: ``0.912, 0.887, 0.941``."""
    return ", ".join(f"{x:.3f}" for x in ratios)


def cost_lines(
    label: str, ours: list[float], base: list[float], what: str, *, per: str = "a job"
) -> str:
    """Two lines for rates taken side by side, round by round: the ratio of ``ours`` to
    ``base`` per round with its median, and what ``what`` adds in µs ``per`` operation
    (the median of the rounds' differences of 1/rate)."""
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    extra = [1e6 / o - 1e6 / b for o, b in zip(ours, base, strict=True)]
    return (
        ratio_line(label, ratios)
        + f"\n  {what}: {statistics.median(extra):+.0f} µs {per} (median of the rounds)"
    )


def ratio_line(label: str, ratios: list[float], note: str = "") -> str:
    """``label per round: 0.912, 0.887, 0.941  -> median 0.912 (note)``, the rounds in
    the order they ran."""
    return f"{label} per round: {per_round(ratios)}  -> median {statistics.median(ratios):.3f}" + (
        f" ({note})" if note else ""
    )


def summary(name: str, rates: list[float]) -> str:
    return (
        f"{name:<34} median {statistics.median(rates):9.1f}/s   "
        f"min {min(rates):9.1f}/s   max {max(rates):9.1f}/s   (n={len(rates)})"
    )


#: The packages whose files are ours in an opcode count.
OURS = ("celery_explicit", "django_outbox")
_SITE = os.sep + "site-packages" + os.sep


def count_opcodes(run: Callable[[], Any]) -> collections.Counter[tuple[str, str]]:
    """The Python opcodes ``run()`` runs, by (file from its package, function):
    ``sys.settrace`` with ``f_trace_opcodes``. A count, not a time: the machine's speed
    does not move it, so a change of a few µs shows as the same number in every run."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def on_call(frame: FrameType, event: str, _arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return on_opcode

    def on_opcode(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            counts[(_short(code.co_filename), code.co_name)] += 1
        return on_opcode

    sys.settrace(on_call)
    try:
        run()
    finally:
        sys.settrace(None)
    return counts


def _short(path: str) -> str:
    """A file's path from its package: ``celery/app/trace.py``, ``celery_explicit/keys.py``."""
    if _SITE in path:
        return path.split(_SITE, 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return path.removeprefix(root)
