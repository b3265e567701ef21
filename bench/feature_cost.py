"""What a declared feature costs a job, end to end: an ExplicitTask beside the same task
with the feature on, rounds interleaved in one run.

- ``cancellable = True`` (``celery_explicit.cancellation``): one Redis round trip per
  delivery (the two marks) and, in the effect's transaction, an advisory lock and a read
  of the cancellations (no round trip of its own on the one-string commit);
- ``rate_limit = RateLimit(...)`` (``celery_explicit.rate_limit``), a limit never
  reached: one script call per job (the admission);
- the app version (``EXPLICIT_APP_VERSION``, ``celery_explicit.app_version``): a column
  on rows written anyway; the same task on a second worker whose version is set.

A task that does not declare a feature pays nothing for it: the cancellation step is
not built for it, and its effect sends no cancellation statement
(``tests/integration/test_cancellations.py``).

    scripts/bench feature_cost.py [--tasks 1000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from common import check_workers, cost_lines, reset_rows, setup_django, start_worker, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    plain_queue, versioned_queue = (f"bench-{uuid.uuid4().hex[:8]}" for _ in range(2))
    os.environ["EXPLICIT_BENCH_QUEUE"] = plain_queue
    setup_django()

    from django.db.models import Sum

    from bench.benchapp.models import Row
    from bench.benchapp.tasks import CancellableUpdate, ExplicitUpdate, RateLimitedUpdate
    from bench.celery_app import app
    from celery_explicit import app_version

    reset_rows()
    for name in (*app_version.ENVIRONMENT, "EXPLICIT_APP_VERSION"):
        os.environ.pop(name, None)
    workers = [start_worker(plain_queue)]
    os.environ["EXPLICIT_APP_VERSION"] = "bench-2026.12"
    workers.append(start_worker(versioned_queue))
    del os.environ["EXPLICIT_APP_VERSION"]
    time.sleep(5)  # WARNING level prints no "ready": give them time to start

    def total() -> int:
        return int(Row.objects.aggregate(s=Sum("value"))["s"] or 0)

    def run(task, queue: str, n: int) -> float:  # type: ignore[no-untyped-def]
        target = total() + n
        start = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for i in range(n):
                task.apply_async(args=[i % 100, uuid.uuid4().hex], queue=queue, producer=producer)
        while total() < target:
            time.sleep(0.01)
        return n / (time.perf_counter() - start)

    sides = {
        "ExplicitTask": (ExplicitUpdate(), plain_queue),
        "cancellable = True": (CancellableUpdate(), plain_queue),
        "rate_limit = RateLimit(...)": (RateLimitedUpdate(), plain_queue),
        "EXPLICIT_APP_VERSION set": (ExplicitUpdate(), versioned_queue),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for task, queue in sides.values():
            run(task, queue, 200)  # warm-up: pool children, connections
        for r in range(args.rounds):
            order = list(sides.items())
            for name, (task, queue) in order if r % 2 == 0 else reversed(order):
                rates[name].append(run(task, queue, args.tasks))
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(30)
    check_workers(*workers)
    base = rates["ExplicitTask"]
    for name, side in rates.items():
        print(summary(name, side))
    for name, side in rates.items():
        if side is base:
            continue
        print(cost_lines(f"{name} / ExplicitTask", side, base, name))


if __name__ == "__main__":
    main()
