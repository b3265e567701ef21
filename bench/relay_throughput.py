"""Outbox relay throughput (events/s) against kombu's own batched publish of the same
messages.

A backlog of N pending outbox events (an ExplicitTask with an idempotency key), written
as ``django_outbox.outbox.events.write`` writes them (key and correlation id in the stored
headers), is relayed by ``Relay.drain()`` in this process: claim (FOR UPDATE SKIP
LOCKED), build each Celery message (arguments bound, key rendered), publish through
kombu's ``Producer.batch`` pipeline, mark published, commit. The baselines publish the
same Celery messages, built beforehand with ``app.amqp.create_task_message`` and the
headers the relay adds: with kombu's ``Producer.batch()`` pipeline (the one the target
is against: P3b in docs/performance.md) and with ``Producer.publish`` in a loop (one
Redis round trip each). Same Redis, same queue, rounds interleaved; the ratio is taken
per round, then the median. Target: relay / kombu batched >= 0.8 at batch 500.

Also at the largest batch size, three references with no code of ours:

- a relay written by hand, what a team would write: the claim (the relay's statement)
  through Django's cursor, each row's message built by Celery's
  ``create_task_message`` with the relay's headers, kombu's ``Producer.batch()``, the
  marks and COMMIT;
- the same relay by hand through Celery's own send path, the cheapest way Celery
  allows: ``create_task_message`` given the arguments' reprs (``repr()``, not
  ``saferepr``) and ``app.amqp.send_task_message`` (the publish signals, the
  exchange and routing Celery adds). No code of ours runs in it: what it reads
  against kombu's batched publish is what P3b could read with our per-event Python
  at zero, unless Celery's send path itself were replaced;
- its claim and marks alone (no message built or sent). Their time added to kombu's
  batched publish gives P3b's ceiling: what the relay would read if its only cost
  beyond the baseline were the statements every relay of a table sends.
- the relay with ``EXPLICIT_OUTBOX_PREPARED_MESSAGES`` on: each row carries its broker
  message, built by ``publish_event`` when it was written
  (``django_outbox.outbox.prepared``); ``Relay.drain()`` claims, pushes the stored
  bytes in one pipeline, marks and commits. Its price is the writer's: timed beside,
  the CPU an event costs ``publish_event`` in ``atomic()``, with the setting off and on.

    scripts/bench relay_throughput.py [--events 5000] [--rounds 3] [--batch-sizes 10,100,500]
    scripts/bench relay_throughput.py --opcodes [--events 500] [--top 15]
    make bench-p3

``--opcodes`` times nothing: it counts the Python opcodes an event costs the relay
(``sys.settrace``, as ``opcodes_per_job.py``), building its message and pushing a
prepared one, at the largest batch size, with the functions of ours that run the most:
the same count on every run whatever the machine's speed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

from common import OURS, count_opcodes, per_round, setup_django, summary, vacuum


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="10,100,500")
    parser.add_argument("--opcodes", action="store_true", help="count opcodes, time nothing")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    import redis
    from django.conf import settings as django_settings
    from django.db import connection, transaction
    from django.test import override_settings

    from bench.benchapp.tasks import ExplicitUpdate
    from bench.celery_app import app
    from django_outbox.db.relay_sql import SORT_DEFAULT, SORT_OFF
    from django_outbox.models import OutboxEvent
    from django_outbox.outbox.events import publish_event
    from django_outbox.outbox.relay.claim import CLAIM_POSTGRESQL
    from django_outbox.outbox.relay.loop import Relay

    task = app.tasks[ExplicitUpdate.name]
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    n = args.events

    def fill(prepared: bool = False) -> None:
        OutboxEvent.objects.all().delete()
        vacuum()  # each round starts without the last round's dead rows
        if prepared:
            # Written by the writer itself, with the setting on (not timed).
            with override_settings(EXPLICIT_OUTBOX_PREPARED_MESSAGES=True), transaction.atomic():
                for i in range(n):
                    publish_event(task.name, {"row_id": i % 100, "op_id": uuid.uuid4().hex})
            assert not OutboxEvent.objects.filter(message="").exists(), "every row prepared"
            vacuum()
            return
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

    def relay_rate(
        batch_size: int, prepared: bool = False, opcodes: collections.Counter[Any] | None = None
    ) -> float:
        """The relay's events/s over the backlog; with ``opcodes``, the drain is run
        under ``count_opcodes`` and its count added there (the rate is then not one)."""
        fill(prepared)
        broker.delete(queue)
        relay = Relay(batch_size=batch_size, notify_channel="")
        drained = []
        start = time.perf_counter()
        if opcodes is None:
            drained.append(relay.drain())
        else:
            opcodes.update(count_opcodes(lambda: drained.append(relay.drain())))
        elapsed = time.perf_counter() - start
        result = drained[0]
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

    @contextlib.contextmanager
    def connected_producer() -> Iterator[Any]:
        """A producer whose connection is made outside the timing, on an empty queue."""
        with app.connection_for_write() as conn:
            producer = conn.Producer(auto_declare=False)
            producer.publish("warm-up", routing_key=queue)
            broker.delete(queue)
            yield producer

    def claim_rows(cursor: Any, sql: str, batch_size: int) -> list[Any]:
        """One batch's claim, planned as the relay plans it (sorts off)."""
        cursor.execute(SORT_OFF)
        cursor.execute(sql, {"limit": batch_size})
        rows = cursor.fetchall()
        cursor.execute(SORT_DEFAULT)
        return rows  # type: ignore[no-any-return]

    def mark_published(cursor: Any, rows: list[Any]) -> None:
        """The relay's marks of one batch, by the ids in each row's first column."""
        ids = ",".join(str(row[0]) for row in rows)
        cursor.execute(
            "SET LOCAL synchronous_commit TO OFF; "
            "UPDATE django_outbox_event SET status = 'published', "
            "attempts = attempts + 1, published_at = statement_timestamp() "
            f"WHERE id = ANY('{{{ids}}}'::bigint[])"
        )

    def by_hand_rate(batch_size: int, *, publish: bool = True, celery_send: bool = False) -> float:
        """Claim, build, publish in one pipeline, mark, commit: no code of ours.
        ``publish=False``: the claim and the marks alone. ``celery_send``: the reprs
        by ``repr()`` and the message sent through Celery's ``send_task_message``."""
        fill()
        broker.delete(queue)
        published = 0
        with connected_producer() as producer:
            start = time.perf_counter()
            while True:
                with transaction.atomic(), connection.cursor() as cursor:
                    rows = claim_rows(cursor, CLAIM_POSTGRESQL, batch_size)
                    if not rows:
                        break
                    if publish:
                        with producer.batch(max_size=2 * len(rows) + 1):
                            for _id, event_id, name, args_, kwargs, stored, *_rest in rows:
                                # Django reads jsonb as text (JSONField decodes it).
                                headers = json.loads(stored)
                                args_, kwargs = json.loads(args_), json.loads(kwargs)
                                sent_at = time.time()
                                if celery_send:
                                    send_by_celery(
                                        producer,
                                        str(event_id),
                                        name,
                                        args_,
                                        kwargs,
                                        {
                                            **headers,
                                            "explicit_published_via": "outbox",
                                            "explicit_sent_at": sent_at,
                                        },
                                        sent_at,
                                    )
                                    continue
                                message = app.amqp.create_task_message(
                                    str(event_id), name, args_, kwargs
                                )
                                producer.publish(
                                    message.body,
                                    routing_key=queue,
                                    serializer="json",
                                    headers={
                                        **message.headers,
                                        **headers,
                                        "explicit_published_via": "outbox",
                                        "explicit_sent_at": sent_at,
                                    },
                                    **{**message.properties, "timestamp": int(sent_at)},
                                )
                    mark_published(cursor, rows)
                    published += len(rows)
            elapsed = time.perf_counter() - start
        sent = broker.llen(queue)
        assert published == n and sent == (n if publish else 0), (published, sent)
        return n / elapsed

    def send_by_celery(
        producer: Any,
        task_id: str,
        name: str,
        args_: list[Any],
        kwargs: dict[str, Any],
        headers: dict[str, Any],
        sent_at: float,
    ) -> None:
        """One event through Celery's own message building and send path, reprs by
        ``repr()``: what ``Celery.send_task`` does with no router, no options."""
        message = app.amqp.create_task_message(
            task_id,
            name,
            args_,
            kwargs,
            argsrepr=repr(args_),
            kwargsrepr=repr(kwargs),
        )
        # The message's timestamp property, as the relay sets it: send_task_message
        # hands its other keyword arguments to kombu as properties.
        app.amqp.send_task_message(
            producer,
            name,
            message,
            queue=queue,
            headers=headers,
            retry=False,
            declare=[],
            timestamp=int(sent_at),
        )

    def write_rate(prepared: bool) -> float:
        """CPU µs an event costs the writer's transaction: ``publish_event`` in
        ``atomic()``, with ``EXPLICIT_OUTBOX_PREPARED_MESSAGES`` off or on."""
        with override_settings(EXPLICIT_OUTBOX_PREPARED_MESSAGES=prepared):
            start = time.process_time()
            with transaction.atomic():
                for i in range(n):
                    publish_event(task.name, {"row_id": i % 100, "op_id": uuid.uuid4().hex})
            spent = (time.process_time() - start) / n * 1e6
        assert OutboxEvent.objects.filter(message="").exists() is not prepared
        OutboxEvent.objects.all().delete()
        return spent

    def raw_rate(batched: bool) -> float:
        prepared = messages()
        broker.delete(queue)
        with connected_producer() as producer:
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

    if args.opcodes:
        largest = max(batch_sizes)
        relay_rate(largest)  # warm-up: connections, imports
        relay_rate(largest, prepared=True)
        try:
            for label, prepared_on in (("building", False), ("prepared", True)):
                counted: collections.Counter[tuple[str, str]] = collections.Counter()
                relay_rate(largest, prepared_on, counted)
                ours = {key: c for key, c in counted.items() if key[0].startswith(OURS)}
                print(
                    f"relay, {label} messages, batch {largest}: "
                    f"{sum(counted.values()) / n:.1f} opcodes an event, "
                    f"{sum(ours.values()) / n:.1f} of them ours; the most:"
                )
                for (path, function), c in sorted(ours.items(), key=lambda i: -i[1])[: args.top]:
                    print(f"  {c / n:7.1f}  {path}:{function}")
        finally:
            broker.delete(queue)
            OutboxEvent.objects.all().delete()
        return

    relay_rate(100)  # warm-up: connections, imports
    raw_rate(False)
    raw: list[float] = []
    raw_batched: list[float] = []
    relayed: dict[int, list[float]] = {b: [] for b in batch_sizes}
    by_hand: list[float] = []
    celery_path: list[float] = []
    statements: list[float] = []
    prepared: list[float] = []
    writes: list[float] = []
    writes_prepared: list[float] = []
    largest = max(batch_sizes)
    by_hand_rate(largest)  # warm-up
    relay_rate(largest, prepared=True)
    try:
        for _ in range(args.rounds):
            raw.append(raw_rate(False))
            raw_batched.append(raw_rate(True))
            for b in batch_sizes:
                relayed[b].append(relay_rate(b))
            by_hand.append(by_hand_rate(largest))
            celery_path.append(by_hand_rate(largest, celery_send=True))
            statements.append(by_hand_rate(largest, publish=False))
            prepared.append(relay_rate(largest, prepared=True))
            writes.append(write_rate(False))
            writes_prepared.append(write_rate(True))
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
            + f" (rounds {per_round(vs_batch)})"
            + f"   / raw loop {statistics.median(vs_loop):.2f}"
        )
    relay = relayed[largest]
    vs_hand = [r / h for r, h in zip(relay, by_hand, strict=True)]
    print(
        summary(f"a relay by hand, batch size {largest}", by_hand)
        + "   / kombu batched "
        + f"{statistics.median(h / k for h, k in zip(by_hand, raw_batched, strict=True)):.3f}"
        + f"   the relay / it: {statistics.median(vs_hand):.3f}"
        + f" (rounds {per_round(vs_hand)})"
    )
    vs_celery = [c / k for c, k in zip(celery_path, raw_batched, strict=True)]
    print(
        summary(f"by hand through Celery's send path, batch {largest}", celery_path)
        + f"   / kombu batched {statistics.median(vs_celery):.3f}"
        + f" (rounds {per_round(vs_celery)})"
        + "   the relay / it: "
        + f"{statistics.median(r / c for r, c in zip(relay, celery_path, strict=True)):.3f}"
    )
    print(summary(f"its claim and marks alone, batch {largest}", statements))
    # Per round: kombu's time per event plus the statements' time per event.
    ceiling = [1 / (1 + k / c) for k, c in zip(raw_batched, statements, strict=True)]
    print(
        f"P3b's ceiling, kombu batched with the claim and marks added, per round: "
        f"{per_round(ceiling)} -> median {statistics.median(ceiling):.3f}"
    )
    vs_prepared = [p / k for p, k in zip(prepared, raw_batched, strict=True)]
    print(
        summary(f"relay, prepared messages, batch size {largest}", prepared)
        + f"   / kombu batched {statistics.median(vs_prepared):.3f}"
        + f" (rounds {per_round(vs_prepared)})"
    )
    priced = [w / p for w, p in zip(writes_prepared, writes, strict=True)]
    print(
        f"the writer's price, CPU µs an event written in its transaction: "
        f"{statistics.median(writes):.0f}, with its message prepared "
        f"{statistics.median(writes_prepared):.0f} (per round x {per_round(priced)} "
        f"-> median {statistics.median(priced):.2f})"
    )
    print("target: relay / kombu Producer.batch() >= 0.8 at batch size 500")


if __name__ == "__main__":
    main()
