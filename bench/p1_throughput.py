"""P1: end-to-end throughput of an ExplicitTask vs a plain acks_late task, same update.

Both tasks do one PostgreSQL row update in a transaction; the ExplicitTask adds its
contract (key rendered at publish and in the worker, ledger row in the effect's
transaction, one attempt row). Same broker (Redis), same worker (prefork -c 2,
acks_late, prefetch 4, results off), rounds interleaved in one run. Target: >= 0.90.

    .venv/bin/python bench/p1_throughput.py [--tasks 1000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from common import reset_rows, setup_django, start_worker, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run bench.floor_update: the contract's statements "
        "by hand, with none of our Python (bench/benchapp/tasks.py)",
    )
    args = parser.parse_args()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    from django.db.models import Sum

    from bench.benchapp.models import Row
    from bench.benchapp.tasks import ExplicitUpdate, floor_update, plain_update
    from bench.celery_app import app

    reset_rows()

    worker = start_worker(queue)
    time.sleep(4)  # WARNING level prints no "ready": give it time to start

    def total() -> int:
        return int(Row.objects.aggregate(s=Sum("value"))["s"] or 0)

    def run(task, n: int) -> float:  # type: ignore[no-untyped-def]
        target = total() + n
        start = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for i in range(n):
                task.apply_async(args=[i % 100, uuid.uuid4().hex], queue=queue, producer=producer)
        while total() < target:
            time.sleep(0.01)
        return n / (time.perf_counter() - start)

    try:
        run(plain_update, 200)  # warm-up: pool children, connections
        run(ExplicitUpdate(), 200)
        plain: list[float] = []
        explicit: list[float] = []
        floor: list[float] = []
        if args.floor:
            run(floor_update, 200)
        for r in range(args.rounds):
            order = [(plain_update, plain), (ExplicitUpdate(), explicit)]
            if args.floor:
                order.append((floor_update, floor))
            for task, rates in order if r % 2 == 0 else reversed(order):
                rates.append(run(task, args.tasks))
    finally:
        worker.terminate()
        worker.wait(30)
    print(summary("plain acks_late task", plain))
    print(summary("ExplicitTask (effect + attempt)", explicit))
    ratios = [e / p for e, p in zip(explicit, plain, strict=True)]
    print(
        f"P1 ratio per round: {', '.join(f'{r:.3f}' for r in ratios)}  -> median "
        f"{sorted(ratios)[len(ratios) // 2]:.3f} (target >= 0.90)"
    )
    if args.floor:
        print(summary("floor (the statements by hand)", floor))
        floors = [f / p for f, p in zip(floor, plain, strict=True)]
        print(
            f"floor / plain per round: {', '.join(f'{r:.3f}' for r in floors)}  -> "
            f"median {sorted(floors)[len(floors) // 2]:.3f} (the best P1 could be)"
        )
        over_floor = [e / f for e, f in zip(explicit, floor, strict=True)]
        print(
            f"P1a ExplicitTask / floor per round: {', '.join(f'{r:.3f}' for r in over_floor)}"
            f"  -> median {sorted(over_floor)[len(over_floor) // 2]:.3f} (target >= 0.95)"
        )


if __name__ == "__main__":
    main()
