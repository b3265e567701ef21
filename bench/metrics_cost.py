"""What the worker's metrics endpoint costs per job: two workers side by side, one run.

Two prefork workers (-c 2, prefetch 4), the same ExplicitUpdate (one row update in an
effect: ledger row, attempt row), each on a queue of its own: one with
``EXPLICIT_WORKER_METRICS_PORT`` (its pool writes every metric to prometheus_client's
mmap files, its main process serves them, scraped every ``--scrape-interval`` seconds
during its rounds, far more often than Prometheus would), one without (values in
memory, nothing served). Rounds alternate which goes first; the cost per job is
``1/rate_on - 1/rate_off``. Then the same metric writes a job makes, timed alone in
this process: in memory, then in files.

    .venv/bin/python bench/metrics_cost.py [--tasks 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable

# A database and Redis databases of this bench's own, unless told otherwise.
os.environ.setdefault("EXPLICIT_BENCH_DB", "explicit_bench_metrics")
os.environ.setdefault("EXPLICIT_BENCH_BROKER_URL", "redis://127.0.0.1:6379/11")
os.environ.setdefault("EXPLICIT_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
os.environ.setdefault("EXPLICIT_TEST_CACHE_URL", "redis://127.0.0.1:6379/10")

from common import check_workers, ratio_line, reset_rows, setup_django, start_worker, summary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scraper(port: int, interval: float, stop: threading.Event, sizes: list[int]) -> None:
    while not stop.wait(interval):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                sizes.append(len(r.read()))
        except OSError:
            pass


def micro(n: int) -> tuple[float, float]:
    """Microseconds for one job's metric writes (an execution counted, an effect
    counted, an attempt's duration observed), in memory and then in files."""
    from celery_explicit import metrics, worker_metrics

    def one_job() -> None:
        metrics.executions.labels("bench.micro", "applied").inc()
        metrics.effects_applied.labels("bench.micro").inc()
        metrics.attempt_duration_seconds.labels("bench.micro").observe(0.004)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    memory = timed(one_job)
    with tempfile.TemporaryDirectory() as directory:
        worker_metrics.switch_to_files(directory)
        files = timed(one_job)
    return memory, files


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args()
    setup_django()

    from django.db.models import Sum

    from bench.benchapp.models import Row
    from bench.benchapp.tasks import ExplicitUpdate
    from bench.celery_app import app

    reset_rows()
    run_id = uuid.uuid4().hex[:6]
    queues = {"on": f"bench-m-on-{run_id}", "off": f"bench-m-off-{run_id}"}
    port = free_port()
    metrics_dir = tempfile.mkdtemp(prefix="bench-metrics-")
    workers = {
        "on": start_worker(
            queues["on"],
            *("-n", f"{queues['on']}@%h"),
            extra_env={
                "EXPLICIT_WORKER_METRICS_PORT": str(port),
                "EXPLICIT_METRICS_DIR": metrics_dir,
            },
        ),
        "off": start_worker(queues["off"], "-n", f"{queues['off']}@%h"),
    }
    time.sleep(5)  # WARNING level prints no "ready": give both time to start

    def total() -> int:
        return int(Row.objects.aggregate(s=Sum("value"))["s"] or 0)

    task = ExplicitUpdate()

    def run(which: str, n: int) -> float:
        target = total() + n
        stop = threading.Event()
        sizes: list[int] = []
        thread = threading.Thread(target=scraper, args=(port, args.scrape_interval, stop, sizes))
        if which == "on":
            thread.start()
        start = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for i in range(n):
                task.apply_async(
                    args=[i % 100, uuid.uuid4().hex], queue=queues[which], producer=producer
                )
        while total() < target:
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
        stop.set()
        if which == "on":
            thread.join()
        return n / elapsed

    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for which in ("on", "off"):
            run(which, 200)  # warm-up: pool children, connections
        for r in range(args.rounds):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            for which in order:
                rates[which].append(run(which, args.tasks))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            exposition = response.read().decode()
    finally:
        for worker in workers.values():
            worker.terminate()
        for worker in workers.values():
            worker.wait(30)
    check_workers(*workers.values())
    served = [
        line
        for line in exposition.splitlines()
        if line.startswith('explicit_executions_total{outcome="applied",task="bench.explicit_')
    ]
    print(summary("endpoint off (values in memory)", rates["off"]))
    print(summary("endpoint on (files, scraped)", rates["on"]))
    costs = [(1 / on - 1 / off) * 1e6 for on, off in zip(rates["on"], rates["off"], strict=True)]
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    print(ratio_line("on / off", ratios))
    print(
        f"cost per job (1/on - 1/off) per round, us: {', '.join(f'{c:+.0f}' for c in costs)}"
        f"  -> median {statistics.median(costs):+.0f} us"
    )
    print(f"served by the 'on' worker: {served}")
    memory, files = micro(100_000)
    print(
        f"one job's metric writes alone (3 metrics, 1 histogram): {memory:.2f} us in memory, "
        f"{files:.2f} us in files (+{files - memory:.2f} us)"
    )


if __name__ == "__main__":
    main()
