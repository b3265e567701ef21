"""Peers: celery-once, celery-singleton, a hand-rolled guard, ExplicitTask.

The same business job for all (bench/benchapp/tasks.py, peer_tasks.py): one row update
in a transaction for one ``op_id``. Three parts, in one run:

1. Publish cost: ``apply_async`` to the Redis broker, no worker, a fresh ``op_id`` each
   call (no duplicates), rounds interleaved with the order rotated; microseconds per
   call, and each peer's per-round difference and ratio to the plain task.
2. What each guarantees, through a real worker (prefork ``-c 2``, acks late):
   (a) the same job published twice while the first is still queued (published before
   the worker starts); (b) the same job published again after the first has run.
   Reported: what the second ``apply_async`` did, and how many times the row moved.
3. Throughput end to end (throughput.py's set-up): jobs/s per peer, per-round ratio to the
   ExplicitTask; P1b (ExplicitTask / the hand-rolled guard, target >= 1.25) and its
   ceiling, the floor / the hand-rolled guard: the floor (``throughput.py``'s) sends
   the ExplicitTask's statements with none of our Python, so the ExplicitTask cannot
   read much above it; and the floor with its fence check but no lease call
   (``bench.floor_update_fenced``): the ceiling with the lease carried inside writes
   the worker makes anyway. The floors run in this part only (a duplicate would fail its
   claim, which it asserts).

    scripts/bench peers.py [--calls 2000] [--rounds 7] [--tasks 1000] [--trounds 3]

Needs the peer packages: ``pip install celery-once celery-singleton``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import uuid
from typing import Any

# A database of its own: other benchmarks reset the shared one's rows while they run.
os.environ.setdefault("EXPLICIT_BENCH_DB", "explicit_bench_peers")

from common import (
    check_workers,
    per_round,
    ratio_line,
    reset_rows,
    setup_django,
    start_worker,
    summary,
)


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000, help="apply_async calls a round")
    parser.add_argument("--rounds", type=int, default=7, help="publish rounds")
    parser.add_argument("--tasks", type=int, default=1000, help="jobs a throughput round")
    parser.add_argument("--trounds", type=int, default=3, help="throughput rounds (0: skip)")
    args = parser.parse_args()
    try:
        import celery_once  # noqa: F401
        import celery_singleton  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"peers.py compares with celery-once and celery-singleton, and {exc.name} is "
            "not installed: .venv/bin/pip install -e '.[bench-peers]'"
        ) from None
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    idle_queue = f"{queue}-nobody"  # the publish part's queue: no worker reads it
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    import redis
    from celery.result import EagerResult
    from celery_singleton import clear_locks
    from django.conf import settings
    from django.db.models import Sum

    from bench.benchapp.models import Row, ensure_processed_table
    from bench.benchapp.peer_tasks import (
        ExplicitDedupUpdate,
        handrolled_update,
        once_update,
        singleton_update,
    )
    from bench.benchapp.tasks import (
        ExplicitUpdate,
        floor_update,
        floor_update_fenced,
        plain_update,
    )
    from bench.celery_app import app
    from django_outbox.models import Attempt

    reset_rows()
    ensure_processed_table()
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    locks = redis.Redis.from_url(settings.EXPLICIT_REDIS_URL)

    def clear_peer_locks() -> None:
        clear_locks(app)  # celery-singleton's own: its keys never expire by default
        for key in locks.scan_iter(match="qo_bench.*", count=1000):  # celery-once's
            locks.delete(key)

    clear_peer_locks()
    handrolled_name = "hand-rolled (Lock + get_or_create)"
    peers: list[tuple[str, Any]] = [
        ("plain Celery task", plain_update),
        ("ExplicitTask", ExplicitUpdate()),
        ("ExplicitTask + dedup_key", ExplicitDedupUpdate()),
        ("celery-once QueueOnce", once_update),
        ("celery-singleton Singleton", singleton_update),
        (handrolled_name, handrolled_update),
    ]
    names = [name for name, _ in peers]
    floor_name = "the floor (its statements by hand)"
    fenced_name = "the floor, fenced, no lease call"
    floors = [floor_name, fenced_name]
    width = max(len(n) for n in [*names, *floors]) + 2

    # --- 1. publish cost, no worker --------------------------------------------------
    def publish(task: Any, n: int) -> float:
        ops = [uuid.uuid4().hex for _ in range(n)]
        start = time.perf_counter()
        for i, op in enumerate(ops):
            task.apply_async(args=[i % 100, op], queue=idle_queue)
        elapsed = time.perf_counter() - start
        broker.delete(idle_queue)
        clear_peer_locks()
        return elapsed / n * 1e6

    for _, task in peers:  # warm-up: connections, pools, settings caches
        publish(task, 200)
    cost: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = peers[r % len(peers) :] + peers[: r % len(peers)]
        for name, task in order:
            cost[name].append(publish(task, args.calls))

    # --- 2a. published twice while the first is queued (before the worker starts) ----
    Row.objects.bulk_create(Row(id=1000 + j) for j in range(2 * len(peers)))

    def second_outcome(first: Any, second: Any) -> str:
        if isinstance(second, EagerResult):
            return f"dropped at publish ({second.state})"
        if second.id == first.id:
            return "dropped at publish (returns the first's handle)"
        return "sent"

    queued: dict[str, tuple[str, str, int]] = {}
    for j, (name, task) in enumerate(peers):
        op = uuid.uuid4().hex
        first = task.apply_async(args=[1000 + j, op])
        second = task.apply_async(args=[1000 + j, op])
        queued[name] = (second_outcome(first, second), op, 1000 + j)

    # --- the worker --------------------------------------------------------------------
    worker = start_worker(queue, "-I", "bench.benchapp.peer_tasks")

    def value(row_id: int) -> int:
        return int(Row.objects.get(id=row_id).value)

    def total() -> int:
        return int(Row.objects.filter(id__lt=100).aggregate(s=Sum("value"))["s"] or 0)

    def attempts(op: str) -> str:
        outcomes = list(
            Attempt.objects.filter(idempotency_key=f"bench:{op}")
            .order_by("started_at")
            .values_list("outcome", flat=True)
        )
        return f"; attempts: {', '.join(outcomes)}" if outcomes else ""

    def settle(seconds: float = 2.0) -> None:
        """Wait for the queue to drain, then for the last jobs (and their unlocks)."""
        deadline = time.monotonic() + 30
        while broker.llen(queue) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(seconds)

    rates: dict[str, list[float]] = {n: [] for n in [*names, *floors]}
    again: dict[str, tuple[str, str, int]] = {}
    try:
        time.sleep(4)  # WARNING level prints no "ready": give it time to start
        settle()
        queued_rows = {name: value(row) for name, (_, _, row) in queued.items()}
        queued_attempts = {name: attempts(op) for name, (_, op, _) in queued.items()}

        # --- 2b. published again after the first has run -------------------------------
        firsts: dict[str, Any] = {}
        for j, (name, task) in enumerate(peers):
            op, row = uuid.uuid4().hex, 1000 + len(peers) + j
            firsts[name] = task.apply_async(args=[row, op])
            again[name] = ("", op, row)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(value(row) < 1 for _, _, row in again.values()):
            time.sleep(0.05)
        time.sleep(1.0)  # the peers unlock after the body returns
        for name, task in peers:
            _, op, row = again[name]
            second = task.apply_async(args=[row, op])
            again[name] = (second_outcome(firsts[name], second), op, row)
        settle()
        again_rows = {name: value(row) for name, (_, _, row) in again.items()}
        again_attempts = {name: attempts(op) for name, (_, op, _) in again.items()}

        # --- 3. throughput end to end ----------------------------------------------------
        def run(task: Any, n: int) -> float:
            target = total() + n
            start = time.perf_counter()
            with app.producer_or_acquire() as producer:
                for i in range(n):
                    task.apply_async(args=[i % 100, uuid.uuid4().hex], producer=producer)
            deadline = time.monotonic() + 120
            while total() < target:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{task.name}: the worker stopped ({total()} < {target})")
                time.sleep(0.01)
            return n / (time.perf_counter() - start)

        timed = [*peers, (floor_name, floor_update), (fenced_name, floor_update_fenced)]
        if args.trounds:
            for _, task in timed:
                run(task, 200)  # warm-up: pool children, connections
        for r in range(args.trounds):
            order = timed[r % len(timed) :] + timed[: r % len(timed)]
            for name, task in order:
                rates[name].append(run(task, args.tasks))
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
        broker.delete(queue)
        clear_peer_locks()
    check_workers(worker)

    print(f"\n1. publish: apply_async to Redis, no worker, {args.calls} calls x {args.rounds}")
    plain = cost[names[0]]
    print(f"{'':<{width}}{'us/call':>9} {'min':>7} {'max':>7} {'+us vs plain':>13} {'ratio':>6}")
    for name in names:
        diffs = [c - p for c, p in zip(cost[name], plain, strict=True)]
        ratios = [c / p for c, p in zip(cost[name], plain, strict=True)]
        print(
            f"{name:<{width}}{median(cost[name]):9.1f} {min(cost[name]):7.1f} "
            f"{max(cost[name]):7.1f} {median(diffs):+13.1f} {median(ratios):6.3f}"
        )
    print("   (+us and ratio: medians of the per-round differences and ratios to plain)")

    print("\n2a. the same job published twice while the first is queued")
    for name in names:
        outcome, op, _ = queued[name]
        print(f"{name:<{width}}second publish: {outcome}; effects: {queued_rows[name]}", end="")
        print(queued_attempts[name])
    print("2b. the same job published again after the first has run")
    for name in names:
        outcome, op, _ = again[name]
        print(f"{name:<{width}}second publish: {outcome}; effects: {again_rows[name]}", end="")
        print(again_attempts[name])

    if args.trounds:
        print(f"\n3. throughput through the worker, {args.tasks} jobs x {args.trounds}")
        explicit = rates[names[1]]
        for name in [*names, *floors]:
            ratios = [r / e for r, e in zip(rates[name], explicit, strict=True)]
            print(
                f"{summary(name, rates[name])}   / ExplicitTask: {per_round(ratios)} "
                f"-> median {median(ratios):.3f}"
            )
        guard = rates[handrolled_name]
        for label, side, note in (
            ("P1b ExplicitTask / hand-rolled", explicit, "target >= 1.25"),
            ("P1b's ceiling, the floor / hand-rolled", rates[floor_name], "none of our Python"),
            (
                "fenced, no lease call / hand-rolled",
                rates[fenced_name],
                "none of our Python, the lease inside the worker's own writes",
            ),
        ):
            print(ratio_line(label, [s / g for s, g in zip(side, guard, strict=True)], note))


if __name__ == "__main__":
    main()
