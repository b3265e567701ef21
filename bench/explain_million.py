"""``explain`` on a database with a million attempt rows: how long one answer takes.

Fills its own database (``EXPLICIT_BENCH_DB``, default ``explicit_bench_explain``) with
``--jobs`` jobs of three attempts each (a retry, then applied; every 50th also
dead-lettered), a ledger row per applied job, in SQL (``generate_series``), once; then
times ``explain.explain`` by idempotency key, task id, dead letter id and business id,
``--repeat`` times each, and the dashboard's queries per window, and prints the median
and the worst.

    scripts/bench explain_million.py [--jobs 340000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("EXPLICIT_BENCH_DB", "explicit_bench_explain")

from common import setup_django

FILL = """
INSERT INTO django_outbox_attempt (task_id, task_name, idempotency_key, attempt,
    redelivered, worker_host, worker_pid, started_at, finished_at, duration_ms, outcome,
    error_class, error_message, retry_delay, correlation_id, external_request_id)
SELECT 'job-' || j, 'shop.ship_order', 'order:' || j || ':ship', a, false, 'worker-1',
    800 + a, now() - (j || ' seconds')::interval + (a || ' ms')::interval,
    now() - (j || ' seconds')::interval + (a || ' ms')::interval + interval '25 ms', 25.0,
    CASE WHEN a < 3 THEN 'retry_scheduled' ELSE 'applied' END,
    CASE WHEN a < 3 THEN 'shop.GatewayTimeout' ELSE '' END, '',
    CASE WHEN a < 3 THEN 1.5 ELSE NULL END, '', ''
FROM generate_series(1, %(jobs)s) AS j, generate_series(1, 3) AS a;
INSERT INTO django_outbox_processed_operation (key, task_name, task_id, fingerprint,
    result_ref, processed_at)
SELECT 'order:' || j || ':ship', 'shop.ship_order', 'job-' || j, 'f', '',
    now() - (j || ' seconds')::interval
FROM generate_series(1, %(jobs)s) AS j;
INSERT INTO django_outbox_dead_letter (task_id, task_name, args, kwargs, raw_body,
    idempotency_key, reason, error_class, error_message, traceback, attempts, first_seen,
    last_attempt, correlation_id, queue, status, replayed_task_id, resolved_by)
SELECT 'job-' || j, 'shop.ship_order', '[]', '{}', '', 'order:' || j || ':ship',
    'permanent', 'shop.Refused', '', '', 1, now(), now(), '', '', 'open', '', ''
FROM generate_series(50, %(jobs)s, 50) AS j;
"""


def fill(jobs: int) -> None:
    """The million rows, written once: filled again only when there are fewer."""
    from django.db import connection

    from django_outbox.models import Attempt

    if Attempt.objects.count() >= jobs * 3:
        return
    print(f"filling: {jobs} jobs, {jobs * 3} attempt rows ...", flush=True)
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE django_outbox_attempt, django_outbox_dead_letter, "
            "django_outbox_processed_operation"
        )
        cursor.execute(FILL, {"jobs": jobs})
        cursor.execute("VACUUM ANALYZE")
    print(f"filled in {time.perf_counter() - started:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=340_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    setup_django()

    from django_outbox.incident import explain
    from django_outbox.models import Attempt, DeadLetter

    fill(args.jobs)
    rows = Attempt.objects.count()
    middle = args.jobs // 2 + 50 - (args.jobs // 2) % 50  # a dead-lettered job
    letter = DeadLetter.objects.get(task_id=f"job-{middle}")
    queries = {
        "idempotency key": f"order:{middle}:ship",
        "task id": f"job-{middle}",
        "dead letter id": str(letter.pk),
        "business id (a key part)": str(middle),
    }
    print(f"{rows} attempt rows")
    for label, what in queries.items():
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            found = explain.explain(what)
            times.append((time.perf_counter() - started) * 1000)
        assert found and found[0].key == f"order:{middle}:ship", (label, found)
        print(
            f"explain by {label:<26} median {statistics.median(times):8.1f} ms   "
            f"worst {max(times):8.1f} ms   (n={args.repeat})"
        )
    # The admin's search box on the attempt list: the same query Django builds from
    # ``search_fields`` (substring of keys, whole task or correlation ids), first page.
    from django.contrib.admin.sites import site
    from django.test import RequestFactory

    attempt_admin = site._registry[Attempt]
    request = RequestFactory().get("/")
    for label, term in (("business id", str(middle)), ("task id", f"job-{middle}")):
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            matched, _dups = attempt_admin.get_search_results(request, Attempt.objects.all(), term)
            hits = list(matched.order_by("-started_at")[:100])
            times.append((time.perf_counter() - started) * 1000)
        assert any(h.idempotency_key == f"order:{middle}:ship" for h in hits), label
        print(
            f"admin search by {label:<19} median {statistics.median(times):8.1f} ms   "
            f"worst {max(times):8.1f} ms   ({len(hits)} rows)"
        )
    # The dashboard's database part on the same rows (its live part reads Redis and the
    # broker): attempts by outcome, dead-letter inflow (plots, links), the open dead
    # letters by reason and the outbox, per window.
    from django.utils import timezone

    from django_outbox.admin import dashboard

    for hours, minutes in dashboard.WINDOWS.items():
        times = []
        for _ in range(max(3, args.repeat // 4)):
            started = time.perf_counter()
            now = timezone.now()
            since = now - timezone.timedelta(hours=hours)
            axis = dashboard.Axis(
                dashboard._buckets(since, now, minutes), minutes, dashboard.TICKS[hours]
            )
            dashboard._attempt_series(since, axis)
            dashboard._dead_letter_series(since, axis)
            dashboard.open_dead_letters(now)
            dashboard._outbox(now, since)
            times.append((time.perf_counter() - started) * 1000)
        print(
            f"dashboard, last {hours:>2} h{'':<18} median {statistics.median(times):8.1f} ms   "
            f"worst {max(times):8.1f} ms"
        )


if __name__ == "__main__":
    main()
