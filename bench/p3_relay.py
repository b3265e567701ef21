"""P3: outbox relay throughput vs kombu's own batched publish of the same messages.

A backlog of N pending outbox events (an ExplicitTask with an idempotency key), written
as ``django_outbox.outbox.write`` writes them (key and correlation id in the stored
headers), is relayed by ``Relay.drain()`` in this process: claim (FOR UPDATE SKIP
LOCKED), build each Celery message (arguments bound, key rendered), publish through
kombu's ``Producer.batch`` pipeline, mark published, commit. The baselines publish the
same Celery messages, built beforehand with ``app.amqp.create_task_message`` and the
headers the relay adds: with kombu's ``Producer.batch()`` pipeline (the one the target
is against: issue 13, P3b) and with ``Producer.publish`` in a loop (one Redis round trip
each). Same Redis, same queue, rounds interleaved; the ratio is taken per round, then
the median. Target: relay / kombu batched >= 0.5 at batch 500.

    ./scripts/bench p3_relay.py [--events 5000] [--rounds 3] [--batch-sizes 10,100,500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

from common import setup_django, summary, vacuum


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="10,100,500")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    import redis
    from django.conf import settings as django_settings

    from bench.benchapp.tasks import ExplicitUpdate
    from bench.celery_app import app
    from django_outbox.models import OutboxEvent
    from django_outbox.relay import Relay

    task = app.tasks[ExplicitUpdate.name]
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    n = args.events

    def fill() -> None:
        OutboxEvent.objects.all().delete()
        vacuum()  # each round starts without the last round's dead rows
        OutboxEvent.objects.bulk_create(
            OutboxEvent(
                task_name=task.name,
                kwargs={"row_id": i % 100, "op_id": uuid.uuid4().hex},
                headers={
                    "idempotency_key": f"bench:{i}",
                    "explicit_correlation_id": uuid.uuid4().hex,
                },
            )
            for i in range(n)
        )

    def relay_rate(batch_size: int) -> float:
        fill()
        broker.delete(queue)
        relay = Relay(batch_size=batch_size, notify_channel="")
        start = time.perf_counter()
        result = relay.drain()
        elapsed = time.perf_counter() - start
        assert result.published == n, result
        assert broker.llen(queue) == n
        relay.close()
        return n / elapsed

    def messages() -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
        """The Celery messages the relay sends, built the way Celery builds them."""
        built = []
        for i in range(n):
            message = app.amqp.create_task_message(
                str(uuid.uuid4()),
                task.name,
                (),
                {"row_id": i % 100, "op_id": uuid.uuid4().hex},
            )
            sent_at = time.time()
            headers = {
                **message.headers,
                # What the relay adds to Celery's own headers and properties.
                "explicit_published_via": "outbox",
                "idempotency_key": f"bench:{i}",
                "explicit_correlation_id": uuid.uuid4().hex,
                "explicit_sent_at": sent_at,
            }
            built.append((message.body, headers, {**message.properties, "timestamp": int(sent_at)}))
        return built

    def raw_rate(batched: bool) -> float:
        prepared = messages()
        broker.delete(queue)
        with app.connection_for_write() as conn:
            producer = conn.Producer(auto_declare=False)
            producer.publish("warm-up", routing_key=queue)  # connect outside the timing
            broker.delete(queue)
            start = time.perf_counter()
            if batched:
                with producer.batch(max_size=1000):
                    for body, headers, properties in prepared:
                        producer.publish(
                            body,
                            routing_key=queue,
                            serializer="json",
                            headers=headers,
                            **properties,
                        )
            else:
                for body, headers, properties in prepared:
                    producer.publish(
                        body, routing_key=queue, serializer="json", headers=headers, **properties
                    )
            elapsed = time.perf_counter() - start
        assert broker.llen(queue) == n
        return n / elapsed

    relay_rate(100)  # warm-up: connections, imports
    raw_rate(False)
    raw: list[float] = []
    raw_batched: list[float] = []
    relayed: dict[int, list[float]] = {b: [] for b in batch_sizes}
    try:
        for _ in range(args.rounds):
            raw.append(raw_rate(False))
            raw_batched.append(raw_rate(True))
            for b in batch_sizes:
                relayed[b].append(relay_rate(b))
    finally:
        broker.delete(queue)
        OutboxEvent.objects.all().delete()

    print(f"P3: {n} events per round, {args.rounds} rounds, Redis broker")
    print(summary("raw kombu publish loop", raw))
    print(summary("raw kombu Producer.batch()", raw_batched))
    for b, rates in relayed.items():
        # Per round: the relay against the kombu batch measured just before it.
        vs_batch = [r / k for r, k in zip(rates, raw_batched, strict=True)]
        vs_loop = [r / k for r, k in zip(rates, raw, strict=True)]
        print(
            summary(f"relay, batch size {b}", rates)
            + f"   / kombu batched {statistics.median(vs_batch):.3f}"
            + f" (rounds {', '.join(f'{x:.3f}' for x in vs_batch)})"
            + f"   / raw loop {statistics.median(vs_loop):.2f}"
        )
    print("target: relay / kombu Producer.batch() >= 0.5 at batch size 500")


if __name__ == "__main__":
    main()
