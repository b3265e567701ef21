"""P3: outbox relay throughput vs a raw kombu publish of the same messages.

A backlog of N pending outbox events (an ExplicitTask with an idempotency key) is
relayed by ``Relay.drain()`` in this process: claim (FOR UPDATE SKIP LOCKED), publish
through ``task.apply_async`` (arguments bound, key rendered, Celery message built,
kombu batch pipeline), mark published, commit. The baseline publishes the same Celery
messages, built beforehand, with kombu's ``Producer.publish`` in a loop (one Redis
round trip each, nothing else); a second baseline sends them through kombu's
``Producer.batch()`` pipeline, the way the relay does. Same Redis, same queue,
rounds interleaved. Target: relay / raw loop >= 0.80.

    ./scripts/bench p3_relay.py [--events 5000] [--rounds 3] [--batch-sizes 10,100,500]
"""

from __future__ import annotations

import argparse
import os
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
                headers={"idempotency_key": f"bench:{i}"},
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
            headers = {**message.headers, "idempotency_key": f"bench:{i}"}
            built.append((message.body, headers, message.properties))
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
    raw_median = sorted(raw)[len(raw) // 2]
    for b, rates in relayed.items():
        median = sorted(rates)[len(rates) // 2]
        print(
            summary(f"relay, batch size {b}", rates)
            + f"   ratio vs raw loop {median / raw_median:.2f}"
        )
    print("target: relay / raw kombu loop >= 0.80")


if __name__ == "__main__":
    main()
