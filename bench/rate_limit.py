"""A keyed rate limit with four workers: is the limit held over a minute, and how long
does a quiet key's job wait behind a noisy key's backlog?

Four workers (prefork ``-c 2`` each) on one queue; the task allows ``--rate`` starts a
second per account (``bench.limited_call``). Each start is written down on the Redis
server's clock, one clock for every worker.

1. Held: a backlog of one account, larger than a minute's worth, published at once.
   Counted: the starts in the first minute from the first start, against ``rate x 60``
   (plus the burst of ``rate`` the limit allows at once), and the most in any second.
   Side by side in the same run, Celery's own ``rate_limit`` at the same rate (each
   worker keeps its own).
2. Fair: one job of a quiet account published alone (its wait with an idle queue),
   then the same right behind a noisy account's backlog of ``--backlog`` jobs. The
   difference is the time the workers take to pass once over the backlog, a deferral
   each; the noisy backlog itself takes ``backlog / rate`` seconds.

    scripts/bench rate_limit.py [--rate 50] [--seconds 60] [--backlog 2000]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from common import check_workers, setup_django, start_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=50)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--backlog", type=int, default=2000)
    args = parser.parse_args()
    os.environ["EXPLICIT_BENCH_RATE"] = str(args.rate)
    setup_django()

    from bench.benchapp.tasks import LimitedCall, limited_call_celery
    from bench.celery_app import app
    from celery_explicit import redis_state

    client = redis_state.client()

    def server_ms() -> int:
        seconds, micros = client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def starts(run_id: str) -> list[tuple[str, int]]:
        rows = [raw.decode().split("|") for raw in client.lrange(f"bench-starts:{run_id}", 0, -1)]
        return sorted(((account, int(ms)) for account, ms in rows), key=lambda r: r[1])

    def with_workers(body):  # type: ignore[no-untyped-def]
        queue = f"bench-rl-{uuid.uuid4().hex[:8]}"
        workers = [start_worker(queue) for _ in range(4)]
        time.sleep(6)  # WARNING level prints no "ready": give them time to start
        try:
            result = body(queue)
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(60)
        check_workers(*workers)
        return result

    def held(task, label: str) -> None:  # type: ignore[no-untyped-def]
        run_id = uuid.uuid4().hex[:8]
        account = f"noisy-{run_id}"
        jobs = int(args.rate * args.seconds * 1.25)

        def body(queue: str) -> list[tuple[str, int]]:
            with app.producer_or_acquire() as producer:
                for job in range(jobs):
                    task.apply_async(
                        kwargs={"account": account, "job": job, "run_id": run_id},
                        queue=queue,
                        producer=producer,
                    )
            time.sleep(args.seconds + 10)
            return starts(run_id)

        rows = with_workers(body)
        times = [ms for _account, ms in rows]
        first = times[0]
        in_minute = sum(1 for t in times if t < first + args.seconds * 1000)
        allowed = args.rate * args.seconds
        busiest, low = 0, 0
        for high, at in enumerate(times):
            while at - times[low] >= 1000:
                low += 1
            busiest = max(busiest, high - low + 1)
        print(
            f"{label:<40} starts in the first {args.seconds} s: {in_minute} "
            f"(limit {allowed} + burst {args.rate}: {in_minute / allowed:.3f} of the limit); "
            f"most in one second {busiest} (limit {args.rate})"
        )

    def quiet_wait(backlog: int) -> tuple[float, float]:
        run_id = uuid.uuid4().hex[:8]
        noisy, quiet = f"noisy-{run_id}", f"quiet-{run_id}"

        def body(queue: str) -> tuple[float, float]:
            with app.producer_or_acquire() as producer:
                for job in range(backlog):
                    LimitedCall().apply_async(
                        kwargs={"account": noisy, "job": job, "run_id": run_id},
                        queue=queue,
                        producer=producer,
                    )
            sent = server_ms()
            LimitedCall().apply_async(
                kwargs={"account": quiet, "job": -1, "run_id": run_id}, queue=queue
            )
            deadline = time.monotonic() + backlog / args.rate + 120
            while time.monotonic() < deadline:
                done = starts(run_id)
                if any(account == quiet for account, _ in done) and len(done) >= min(
                    backlog + 1, args.rate * 5
                ):
                    break
                time.sleep(0.2)
            rows = starts(run_id)
            waited = next(ms for account, ms in rows if account == quiet) - sent
            noisy_behind = sum(
                1 for account, ms in rows if account == noisy and ms <= sent + waited
            )
            return waited / 1000.0, noisy_behind

        return with_workers(body)

    held(LimitedCall(), f"RateLimit {args.rate}/s, 4 workers")
    held(limited_call_celery, f"Celery rate_limit='{args.rate}/s', 4 workers")
    alone, _ = quiet_wait(0)
    behind, noisy_started = quiet_wait(args.backlog)
    print(f"quiet key's job, queue otherwise idle:        waited {alone:.2f} s")
    print(
        f"quiet key's job behind {args.backlog} noisy jobs:    waited {behind:.2f} s "
        f"({noisy_started:.0f} noisy jobs had started by then; the noisy backlog needs "
        f"{args.backlog / args.rate:.0f} s at {args.rate}/s)"
    )


if __name__ == "__main__":
    main()
