"""What the ``django.tasks`` backend adds to a publish: ``@task`` ``enqueue()`` through
``django_outbox.tasks_backend`` beside ``dispatch()`` of the ExplicitTask it runs as,
the same arguments, rounds interleaved in one run. On the worker the job is that
ExplicitTask, so what runs there costs the same; the difference is the publish.

Django 6.1 or later (``django.tasks``' task keywords): run it in a virtual environment
with Django 6.1, e.g. the matrix's newest session
(``$MATRIX_ENVDIR/ci-newest/bin/python bench/django_tasks_cost.py``, after
``scripts/ci-newest``), Redis at ``EXPLICIT_BENCH_BROKER_URL`` and PostgreSQL as for
every bench. Publishes to a queue no worker reads, deleted afterwards.

    python bench/django_tasks_cost.py [--jobs 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
import uuid

from common import cost_lines, setup_django, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django()

    import django

    if django.VERSION < (6, 1):
        raise SystemExit(
            f"django.tasks' backend needs Django 6.1 or later, not {django.__version__}"
        )
    from bench.benchapp.django_tasks import update_row
    from bench.celery_app import app
    from django_outbox import dispatch
    from django_outbox.tasks_backend import explicit_task

    queue = f"bench-dt-{uuid.uuid4().hex[:8]}"
    runs_as = explicit_task(update_row)
    queued = update_row.using(queue_name=queue)

    def via_enqueue(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            queued.enqueue(i % 100, uuid.uuid4().hex)
        return n / (time.perf_counter() - start)

    def via_dispatch(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            dispatch(runs_as, (i % 100, uuid.uuid4().hex), options={"queue": queue})
        return n / (time.perf_counter() - start)

    sides = {"dispatch(ExplicitTask)": via_dispatch, "@task enqueue()": via_enqueue}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for side in sides.values():
            side(200)  # warm-up: connections, the backend's task built once
        for r in range(args.rounds):
            order = list(sides.items())
            for name, side in order if r % 2 == 0 else reversed(order):
                rates[name].append(side(args.jobs))
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    for name, side_rates in rates.items():
        print(summary(f"{name} publishes", side_rates))
    base, ours = rates["dispatch(ExplicitTask)"], rates["@task enqueue()"]
    print(cost_lines("@task enqueue() / dispatch()", ours, base, "enqueue()"))


if __name__ == "__main__":
    main()
