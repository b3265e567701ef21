"""What turning traces on costs per job (``celery_explicit.tracing``), off vs on side by side.

Three measurements, each in µs per operation, tracing off and on interleaved in chunks
of CHUNK operations so that load from elsewhere on the machine slows both alike:

- ``publish``: ``ExplicitUpdate.apply_async`` to a Redis queue (serialising, one LPUSH);
  on: the publish span and its ``traceparent`` in the headers;
- ``delivery``: ``ExplicitUpdate.apply()``, the whole job path in this process (the
  steps' Redis calls, the effect and its ledger row, the attempt row on PostgreSQL);
  on: the attempt span, continuing a ``traceparent`` the message carries;
- ``attempt hook``: the attempt span alone around nothing (extract, start, end), the
  part of ``delivery`` that tracing adds.

Off is OpenTelemetry installed with no provider set (the hook's one check: the API's
proxy provider); on is the SDK's ``TracerProvider`` with a ``BatchSpanProcessor`` and an
exporter that drops every batch (the cost of recording, not of shipping spans).

    scripts/bench tracing_cost.py [--ops 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from common import reset_rows, setup_django

CHUNK = 100
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def interleaved(
    sides: dict[str, Callable[[int], Any]], n: int, switch: Callable[[str], None]
) -> dict[str, float]:
    """One round: µs per operation of each side over n operations, taken in turns;
    ``switch(side)`` before each turn (outside the timing)."""
    spent = dict.fromkeys(sides, 0.0)
    for chunk in range(n // CHUNK):
        for name, fn in sides.items():
            switch(name)
            start = time.perf_counter()
            for i in range(chunk * CHUNK, (chunk + 1) * CHUNK):
                fn(i)
            spent[name] += time.perf_counter() - start
    return {name: spent[name] / n * 1e6 for name in sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    queue = f"bench-tracing-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()
    reset_rows()

    import redis
    from django.conf import settings
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from bench.benchapp.tasks import ExplicitUpdate
    from celery_explicit import tracing

    class Dropped(SpanExporter):
        """Counts the spans by name (that the "on" side recorded what it should), no more."""

        def __init__(self) -> None:
            self.counts: Counter[str] = Counter()

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            self.counts.update(span.name.split(" tests.")[0].split(" bench.")[0] for span in spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    dropped = Dropped()
    provider.add_span_processor(BatchSpanProcessor(dropped))
    task = ExplicitUpdate()
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    run = uuid.uuid4().hex[:8]

    def switch(side: str) -> None:
        tracing.use_tracer_provider(provider if side == "on" else None)

    def publish(side: str) -> Callable[[int], Any]:
        return lambda i: task.apply_async(kwargs={"row_id": i % 100, "op_id": f"{side}{i}"})

    def deliver(side: str) -> Callable[[int], Any]:
        def call(i: int) -> Any:
            op = f"{run}-{side}-{i}-{time.monotonic_ns()}"
            return task.apply(
                kwargs={"row_id": i % 100, "op_id": op}, headers={"traceparent": TRACEPARENT}
            )

        return call

    class Request:
        id = "bench-job"
        retries = 0
        headers: dict[str, Any] = {}
        traceparent = TRACEPARENT
        idempotency_key = "bench:1"

    def hook(i: int) -> None:
        with tracing.attempt(task, Request):
            pass

    measurements = {
        "publish": (publish("off"), publish("on")),
        "delivery": (deliver("off"), deliver("on")),
        "attempt hook": (hook, hook),
    }
    results: dict[str, dict[str, list[float]]] = {
        name: {"off": [], "on": []} for name in measurements
    }
    try:
        for _round in range(options.rounds):
            for name, (off, on) in measurements.items():
                n = options.ops if name != "delivery" else max(CHUNK, options.ops // 10)
                taken = interleaved({"off": off, "on": on}, n, switch)
                for side, micros in taken.items():
                    results[name][side].append(micros)
            broker.delete(queue)
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()
        broker.delete(queue)

    print(f"tracing cost, median of {options.rounds} rounds (µs per operation)")
    print(f"{'':<14}{'off':>10}{'on':>10}{'on - off':>10}   rounds' range off / on")
    for name, sides in results.items():
        off, on = statistics.median(sides["off"]), statistics.median(sides["on"])
        spread = " / ".join(f"{min(sides[s]):.1f}-{max(sides[s]):.1f}" for s in ("off", "on"))
        print(f"{name:<14}{off:>10.1f}{on:>10.1f}{on - off:>10.1f}   {spread}")
    print(f"spans recorded on the 'on' side: {dict(dropped.counts)}")


if __name__ == "__main__":
    main()
