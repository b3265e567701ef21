"""End-to-end throughput (jobs/s) of an ExplicitTask against a plain acks_late task
doing the same update.

Both tasks do one PostgreSQL row update in a transaction; the ExplicitTask adds its
contract (key rendered at publish and in the worker, ledger row in the effect's
transaction, one attempt row). Same broker (Redis), same worker (prefork -c 2,
acks_late, prefetch 4, results off), rounds interleaved in one run. Target (P1 in
docs/performance.md): ExplicitTask / plain >= 0.80.

    scripts/bench throughput.py [--tasks 1000] [--rounds 4] [--floor] [--by-process]
    make bench-p1 | bench-p1-floor | bench-p1-processes

``--floor`` adds a third task, the contract's statements by hand with none of our
Python (P1a: ExplicitTask / floor >= 0.93), and a fourth, the same without the
execution lease's two Redis round trips and its fence check: what a job would cost
with no Redis call from the pool process, the most that moving the lease into the
worker's main process could buy; and a fifth, the floor with its lease taken and given
back by the worker's main process (``MainLeaseRequest``: a blocking call each way in
the main process's loop, the fence handed to the pool child in the request): what that
move buys when the calls stay calls; and a sixth, the floor with its fence check and no
lease call from any process: the most a lease carried inside writes the worker makes
anyway (the delivery's and the ack's scripts on the broker's Redis) could read.
``--by-process`` also prints, for each side, the CPU µs a job spent in each process
of the run (this publisher, the worker's main process, its pool children, PostgreSQL,
Redis; medians of the rounds), read from /proc: where an end-to-end job's cost lands,
beyond the pool child that ``cpu_per_job.py`` measures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from common import (
    ProcessCPU,
    check_workers,
    ratio_line,
    reset_rows,
    setup_django,
    start_worker,
    summary,
)


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
    parser.add_argument(
        "--by-process",
        action="store_true",
        help="also print CPU µs a job by process (publisher, worker main, pool "
        "children, PostgreSQL, Redis) for each side",
    )
    args = parser.parse_args()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    from django.db.models import Sum

    from bench.benchapp.models import Row
    from bench.benchapp.tasks import (
        ExplicitUpdate,
        floor_update,
        floor_update_fenced,
        floor_update_main_lease,
        floor_update_unleased,
        plain_update,
    )
    from bench.celery_app import app

    reset_rows()

    worker = start_worker(queue)
    time.sleep(4)  # WARNING level prints no "ready": give it time to start
    from django.conf import settings

    # Only when asked: it looks the servers' pids up, and reads /proc around each round.
    cpu = ProcessCPU(worker.pid, settings.REDIS_URL) if args.by_process else None
    #: task name -> one {part: CPU µs a job} per measured round
    by_process: dict[str, list[dict[str, float]]] = {}

    def total() -> int:
        return int(Row.objects.aggregate(s=Sum("value"))["s"] or 0)

    def run(task, n: int, *, measured: bool = True) -> float:  # type: ignore[no-untyped-def]
        target = total() + n
        before = cpu.read() if cpu is not None and measured else {}
        start = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for i in range(n):
                task.apply_async(args=[i % 100, uuid.uuid4().hex], queue=queue, producer=producer)
        while total() < target:
            time.sleep(0.01)
        rate = n / (time.perf_counter() - start)
        if cpu is not None and before:
            after = cpu.read()
            by_process.setdefault(task.name, []).append(
                {part: (after[part] - before[part]) / n * 1e6 for part in after}
            )
        return rate

    try:
        run(plain_update, 200, measured=False)  # warm-up: pool children, connections
        run(ExplicitUpdate(), 200, measured=False)
        plain: list[float] = []
        explicit: list[float] = []
        floor: list[float] = []
        unleased: list[float] = []
        main_lease: list[float] = []
        fenced: list[float] = []
        if args.floor:
            run(floor_update, 200, measured=False)
            run(floor_update_unleased, 200, measured=False)
            run(floor_update_main_lease, 200, measured=False)
            run(floor_update_fenced, 200, measured=False)
        for r in range(args.rounds):
            order = [(plain_update, plain), (ExplicitUpdate(), explicit)]
            if args.floor:
                order += [(floor_update, floor), (floor_update_unleased, unleased)]
                order += [(floor_update_main_lease, main_lease), (floor_update_fenced, fenced)]
            for task, rates in order if r % 2 == 0 else reversed(order):
                rates.append(run(task, args.tasks))
    finally:
        worker.terminate()
        worker.wait(30)
    check_workers(worker)
    print(summary("plain acks_late task", plain))
    print(summary("ExplicitTask (effect + attempt)", explicit))
    ratios = [e / p for e, p in zip(explicit, plain, strict=True)]
    print(ratio_line("P1 ratio", ratios, "target >= 0.80"))
    if args.floor:
        print(summary("floor (the statements by hand)", floor))
        floors = [f / p for f, p in zip(floor, plain, strict=True)]
        print(ratio_line("floor / plain", floors, "the best P1 could be"))
        over_floor = [e / f for e, f in zip(explicit, floor, strict=True)]
        print(ratio_line("P1a ExplicitTask / floor", over_floor, "target >= 0.93"))
        print(summary("floor without the execution lease", unleased))
        print(summary("floor, lease in the worker's main", main_lease))
        print(summary("floor, fence check, no lease call", fenced))
        for label, side, against, meaning in (
            ("floor without lease / floor", unleased, floor,
             "the most no Redis call from the pool process could buy"),
            ("floor without lease / plain", unleased, plain,
             "P1's ceiling with the lease out of the pool process"),
            ("floor, lease in main / floor", main_lease, floor,
             "what moving the lease's calls to the main process buys"),
            ("fenced, no lease call / floor", fenced, floor,
             "the most a lease inside the delivery's and the ack's writes could buy"),
            ("fenced, no lease call / plain", fenced, plain,
             "P1's ceiling with such a lease and none of our Python"),
        ):  # fmt: skip
            ratios = [a / b for a, b in zip(side, against, strict=True)]
            print(ratio_line(label, ratios, meaning))
    if args.by_process:
        print("CPU µs a job by process, each the median of the rounds; 'all' is the median")
        print("of each round's sum. The servers count whole: this process's polling for the")
        print("total lands in 'publisher' and 'postgres', and grows with a side's wall time.")
        print(f"  {'':<24}" + "".join(f"{part:>15}" for part in (*ProcessCPU.PARTS, "all")))
        for name, rounds in by_process.items():
            medians = [statistics.median(r[part] for r in rounds) for part in ProcessCPU.PARTS]
            all_parts = statistics.median(sum(r.values()) for r in rounds)
            print(f"  {name:<24}" + "".join(f"{m:15.0f}" for m in (*medians, all_parts)))


if __name__ == "__main__":
    main()
