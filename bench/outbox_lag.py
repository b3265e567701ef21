"""Outbox lag: from the writer's commit to the message in the broker, at a steady rate.

Writer processes commit outbox events (``dispatch(..., durable=True)`` of an
ExplicitTask, NOTIFY included; one per transaction unless ``--per-transaction``) at a
fixed total rate, open loop (a late writer does not slow the schedule down). One
``manage.py explicit_relay`` process (``--relays N``: N of them, sharing the backlog),
woken by LISTEN/NOTIFY, publishes to Redis; a consumer thread BRPOPs the queue and
stamps each message's arrival. Lag = arrival - commit, per event. Target: p99 <= 50 ms
at 1,000 events/s.

    ./scripts/bench outbox_lag.py [--rate 1000] [--seconds 10] [--writers 2]
                                  [--per-transaction 1] [--batch-size 100] [--relays 1]
                                  [--cpu-hog]

``--cpu-hog`` runs a busy loop pinned to the last core for the whole measurement: a
machine where something else takes one of the two cores (the p99 <= 50 ms target
applies there too).

Everything runs on one machine: writers, relay, PostgreSQL, Redis and the consumer
share its cores, and the relay's own cost is mostly Celery's ``apply_async``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

from common import DB_NAME, ROOT, setup_django, vacuum


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def hog() -> None:
    """Spin on the last core until killed."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s, all writers")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--writers", type=int, default=2, help="writer processes")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument(
        "--relays",
        type=int,
        default=1,
        help="relay processes (they share the backlog: FOR UPDATE SKIP LOCKED)",
    )
    parser.add_argument(
        "--per-transaction",
        type=int,
        default=1,
        help="events each writer transaction commits together",
    )
    parser.add_argument(
        "--cpu-hog", action="store_true", help="a busy-loop process on the last core"
    )
    args = parser.parse_args()
    if args.relays < 1:
        parser.error(f"--relays {args.relays}: at least one relay must publish the events")
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    import redis
    from django.conf import settings as django_settings
    from django.db import connection, connections, transaction

    from bench.benchapp.tasks import ExplicitUpdate
    from django_outbox.models import OutboxEvent
    from django_outbox.outbox.dispatch import dispatch

    OutboxEvent.objects.all().delete()
    vacuum()
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    broker.delete(queue)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "EXPLICIT_TEST_DB_NAME": DB_NAME,
        "PYTHONPATH": str(ROOT),
    }
    relays = []
    for _ in range(args.relays):
        relay = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "explicit_relay",
                "--batch-size",
                str(args.batch_size),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        atexit.register(relay.kill)  # a failed run must not leave its relay publishing
        relays.append(relay)
        assert relay.stdout is not None
        # System check warnings may come first (the bench settings' app leaves the test
        # tasks unregistered); the relay's "ready" line follows them.
        before: list[str] = []
        while "ready" not in (ready := relay.stdout.readline()):
            assert ready, "".join(before)
            before.append(ready)
    print(f"{ready.strip()} ({args.relays} relay{'s' if args.relays > 1 else ''})")

    hogging = None
    if args.cpu_hog:
        hogging = multiprocessing.get_context("spawn").Process(target=hog, daemon=True)
        hogging.start()

    total = int(args.rate * args.seconds)
    committed: dict[str, float] = {}
    arrived: dict[str, float] = {}
    done = threading.Event()

    backlog: list[int] = []

    def consume() -> None:
        """Stamp each message's arrival. After a BRPOP, whatever else is queued comes in
        one RPOP with a count, stamped with the time that call returned: an upper bound
        on its arrival. One round trip a message made this thread a bottleneck of its own
        under a CPU hog, so the lag it measured was partly its own."""
        client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
        while len(arrived) < total and not done.is_set():
            item = client.brpop([queue], timeout=1)
            if item is None:
                continue
            bodies = [item[1], *(client.rpop(queue, 1000) or [])]
            now = time.time()
            backlog.append(len(bodies))
            for body in bodies:
                arrived[json.loads(body)["headers"]["id"]] = now

    start = time.time() + 1.0

    def write(worker: int, results: multiprocessing.Queue[dict[str, float]]) -> None:
        """One writer process: its share of the schedule, one event per transaction."""
        task = ExplicitUpdate()
        stamps: dict[str, float] = {}
        group = args.per_transaction
        for first in range(worker * group, total, args.writers * group):
            due = start + first / args.rate
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            with transaction.atomic():
                ids = [
                    dispatch(task, kwargs={"row_id": i % 100, "op_id": f"lag{i}"}, durable=True)
                    for i in range(first, min(first + group, total))
                ]
            now = time.time()
            stamps.update((event_id, now) for event_id in ids)
        connection.close()
        results.put(stamps)

    # Each writer opens its own database connection after the fork.
    connections.close_all()
    context = multiprocessing.get_context("fork")
    results: multiprocessing.Queue[dict[str, float]] = context.Queue()
    writers = [context.Process(target=write, args=(w, results)) for w in range(args.writers)]
    consumer = threading.Thread(target=consume)
    consumer.start()
    for w in writers:
        w.start()
    for _ in writers:
        committed.update(results.get())
    for w in writers:
        w.join()
    wrote = max(committed.values()) - start
    deadline = time.time() + 30
    while len(arrived) < total and time.time() < deadline:
        time.sleep(0.1)
    done.set()
    consumer.join()
    for relay in relays:
        relay.terminate()
    for relay in relays:
        relay.wait(30)
    if hogging is not None:
        hogging.kill()
        hogging.join()
    broker.delete(queue)
    OutboxEvent.objects.all().delete()

    lags = [(arrived[k] - committed[k]) * 1000 for k in committed if k in arrived]
    print(
        f"outbox lag: {total} events written in {wrote:.1f}s "
        f"({total / wrote:.0f} events/s by {args.writers} writers, "
        f"{args.per_transaction} per transaction), "
        f"{len(lags)} arrived" + (", a CPU hog on one core" if args.cpu_hog else "")
    )
    print(
        f"commit -> broker: p50 {percentile(lags, 50):.1f} ms   p90 {percentile(lags, 90):.1f} ms"
        f"   p99 {percentile(lags, 99):.1f} ms   max {max(lags):.1f} ms   "
        f"mean {statistics.mean(lags):.1f} ms   (target p99 <= 50 ms)"
    )
    print(
        f"consumer: {len(backlog)} reads, at most {max(backlog)} messages waiting at once "
        "(a large figure: the relay published a backlog in a burst, or this consumer fell "
        "behind)"
    )


if __name__ == "__main__":
    main()
