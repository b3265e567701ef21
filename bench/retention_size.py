"""Retention: rows and bytes per million jobs in each table, before and after a prune.

Jobs of an ExplicitTask (one row update in its effect) are written to the outbox
(``dispatch(..., durable=True)``), published by a ``manage.py explicit_relay`` and run by
a real worker (prefork ``-c 2``): each leaves the rows a production job leaves. Then
every table is measured (``count(*)``, ``pg_total_relation_size``: heap, indexes and
TOAST) minus the same tables emptied and ``VACUUM FULL``-ed before the run, and scaled
to a million jobs. Then the rows are aged past every retention (their timestamps moved
400 days back), ``manage.py explicit_prune`` runs, and the tables are measured again
after a plain ``VACUUM`` (what autovacuum does: the space is kept for new rows, not
given back to the file system) and after ``VACUUM FULL``.

    EXPLICIT_BENCH_DB=explicit_bench_retention .venv/bin/python bench/retention_size.py \
        [--jobs 5000]

Successful jobs write no dead letter and no fence: those tables stay at zero here.
"""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import time
import uuid

from common import DB_NAME, ROOT, check_workers, reset_rows, setup_django, start_worker

TABLES = {
    "attempts": "django_outbox_attempt",
    "ledger": "django_outbox_processed_operation",
    "outbox": "django_outbox_event",
    "dead_letters": "django_outbox_dead_letter",
    "fences": "django_outbox_fence",
}


def measure() -> dict[str, tuple[int, int]]:
    """Per table: (rows, bytes)."""
    from django.db import connection

    found = {}
    with connection.cursor() as cursor:
        for name, table in TABLES.items():
            cursor.execute(f"SELECT count(*), pg_total_relation_size('{table}') FROM {table}")
            rows, size = cursor.fetchone()
            found[name] = (int(rows), int(size))
    return found


def vacuum(full: bool) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        for table in TABLES.values():
            cursor.execute(f"VACUUM {'FULL ' if full else ''}ANALYZE {table}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=5000)
    args = parser.parse_args()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    from django.core.management import call_command
    from django.db import connection, transaction

    from bench.benchapp.tasks import ExplicitUpdate
    from bench.celery_app import app
    from django_outbox.models import DeadLetter, Fence, OutboxEvent, PruneRecord
    from django_outbox.outbox.dispatch import dispatch

    task = app.tasks[ExplicitUpdate.name]  # the registered instance
    reset_rows()
    for model in (OutboxEvent, DeadLetter, Fence, PruneRecord):
        model.objects.all().delete()
    vacuum(full=True)
    empty = measure()

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "EXPLICIT_TEST_DB_NAME": DB_NAME,
        "PYTHONPATH": str(ROOT),
    }
    relay = subprocess.Popen(
        [sys.executable, "-m", "django", "explicit_relay"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    atexit.register(relay.kill)
    worker = start_worker(queue)
    atexit.register(worker.kill)

    started = time.monotonic()
    for start in range(0, args.jobs, 100):
        with transaction.atomic():
            for i in range(start, min(start + 100, args.jobs)):
                dispatch(
                    task,
                    kwargs={"row_id": i % 100, "op_id": f"size{i}"},
                    durable=True,
                    options={"queue": queue},
                )
    with connection.cursor() as cursor:
        while True:
            cursor.execute("SELECT count(*) FROM django_outbox_attempt")
            if cursor.fetchone()[0] >= args.jobs:
                break
            if time.monotonic() - started > 1800:
                raise SystemExit("the jobs did not finish in 30 minutes")
            time.sleep(0.5)
    worker.terminate()
    relay.terminate()
    worker.wait(60)
    relay.wait(60)
    check_workers(worker)
    print(f"{args.jobs} jobs in {time.monotonic() - started:.0f}s")
    vacuum(full=False)
    before = measure()

    with connection.cursor() as cursor:
        back = "interval '400 days'"
        cursor.execute(f"UPDATE django_outbox_attempt SET started_at = started_at - {back}")
        cursor.execute(
            f"UPDATE django_outbox_processed_operation SET processed_at = processed_at - {back}"
        )
        cursor.execute(
            f"UPDATE django_outbox_event SET published_at = published_at - {back}, "
            f"created_at = created_at - {back}"
        )
    call_command("explicit_prune", "--batch-size", "1000")
    vacuum(full=False)
    pruned = measure()
    vacuum(full=True)
    compacted = measure()

    scale = 1_000_000 / args.jobs
    print(
        f"\n{'table':<13}{'rows/1M jobs':>14}{'MB/1M jobs':>12}"
        f"{'after prune: rows':>19}{'MB (VACUUM)':>13}{'MB (FULL)':>11}"
    )
    for name in TABLES:
        rows, size = before[name]
        grown = max(0, size - empty[name][1])
        print(
            f"{name:<13}{rows * scale:>14,.0f}{grown * scale / 1e6:>12,.0f}"
            f"{pruned[name][0]:>19,}{pruned[name][1] / 1e6:>13,.1f}"
            f"{compacted[name][1] / 1e6:>11,.2f}"
        )
    total = sum(max(0, before[n][1] - empty[n][1]) for n in TABLES)
    print(f"{'all':<13}{'':>14}{total * scale / 1e6:>12,.0f}   ({total / args.jobs:,.0f} B a job)")


if __name__ == "__main__":
    main()
