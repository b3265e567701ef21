"""The relay's cost of sending one message, by send path, inside one producer pipeline.

What ``django_outbox/outbox/relay/celery_send.py`` keeps a copy of Celery's send path
for: N events of the bench's ExplicitTask sent through kombu's ``Producer.batch`` by

- ``relay``: the relay's sender (``CeleryMessages.send``: our headers stamped, then the
  batch's copy of Celery's send path);
- ``send_task``: ``app.send_task(..., producer=...)``, the public path taking the same
  producer, given the same headers;
- ``apply_async``: ``task.apply_async(..., producer=...)``, which stamps the headers
  itself.

Rounds interleave the paths; each prints its median µs per event. Every message is
checked to have reached the queue.

    scripts/bench relay_send_path.py [--events 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

from common import setup_django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    import redis
    from django.conf import settings

    from bench.benchapp.tasks import ExplicitUpdate
    from bench.celery_app import app
    from celery_explicit.headers import stamp
    from django_outbox.outbox.relay.publish import CeleryMessages

    task = app.tasks[ExplicitUpdate.name]
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    n = args.events

    def one_round(path: str, producer: Any) -> float:
        messages = CeleryMessages(app, producer)
        events = [
            ({"row_id": i % 100, "op_id": uuid.uuid4().hex}, str(uuid.uuid4())) for i in range(n)
        ]
        broker.delete(queue)
        start = time.perf_counter()
        with producer.batch(max_size=2 * n + 1):
            for kwargs, task_id in events:
                headers = {"explicit_published_via": "outbox"}
                if path == "relay":
                    messages.send(task, task_id, (), kwargs, headers, {})
                elif path == "apply_async":
                    task.apply_async(
                        (), kwargs, task_id=task_id, producer=producer, headers=headers, retry=False
                    )
                else:
                    options: dict[str, Any] = {}
                    stamp(task, (), kwargs, headers, options)
                    app.send_task(
                        task.name,
                        (),
                        kwargs,
                        task_id=task_id,
                        producer=producer,
                        headers=headers,
                        retry=False,
                        **options,
                    )
        elapsed = time.perf_counter() - start
        assert broker.llen(queue) == n, (path, broker.llen(queue))
        broker.delete(queue)
        return elapsed / n * 1e6

    paths = ["relay", "send_task", "apply_async"]
    timings: dict[str, list[float]] = {p: [] for p in paths}
    with app.connection_for_write() as conn:
        producer = app.amqp.Producer(conn, auto_declare=False)
        for path in paths:  # warm-up: imports, the queue's declaration, caches
            one_round(path, producer)
        for _ in range(args.rounds):
            for path in paths:
                timings[path].append(one_round(path, producer))
    base = statistics.median(timings["relay"])
    for path in paths:
        median = statistics.median(timings[path])
        rounds = ", ".join(f"{t:.0f}" for t in timings[path])
        print(f"{path:<12} median {median:7.1f} µs an event  x{median / base:.2f}  ({rounds})")


if __name__ == "__main__":
    main()
