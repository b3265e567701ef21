"""The relay's Prometheus metrics (delivery layer), in one place for the operator.

Dead letters are also counted in ``celery_explicit.metrics.dead_letters``, and dedup
drops in ``explicit_dedup_dropped_total``, with every other source of them.

They count in the relay's process (``manage.py explicit_relay``), not a worker's. The
outbox's lag as an operator alerts on it (the oldest pending event's age, rising
whether or not a relay runs) is read from the table by ``django_outbox.incident.metrics_view``;
``publish_lag`` here is insert-to-publish, for the events that were published.

``serve`` is the relay's port (``EXPLICIT_RELAY_METRICS_PORT``), served as a worker's:
on ``EXPLICIT_WORKER_METRICS_BIND`` (127.0.0.1 unless opened), behind
``EXPLICIT_METRICS_TOKEN`` when it is set.

Labels: ``task`` is an outbox row's task name, which ``django_outbox.dispatch``
writes from a task object of the application's code (never from a message);
``error_class`` and ``reason`` come from the code too.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Histogram

from celery_explicit import worker_metrics
from django_outbox.conf import settings

__all__ = [
    "serve",
    "outbox_published",
    "publish_lag",
    "publish_failed",
    "dead_lettered",
    "deduplicated",
    "broker_unavailable",
]

outbox_published = Counter(
    "explicit_outbox_published_total",
    "Outbox events published to the broker (delivery layer). A relay that died "
    "mid-batch publishes its events again: the consumer's idempotency absorbs them.",
    ["task"],
)
publish_lag = Histogram(
    "explicit_outbox_publish_lag_seconds",
    "Seconds from an outbox row's insert to its publish (delivery layer).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600),
)
publish_failed = Counter(
    "explicit_outbox_publish_failed_total",
    "Publishes of one outbox event that failed by themselves (not a broker outage); "
    "the event is retried after a backoff, then dead-lettered.",
    ["task", "error_class"],
)
dead_lettered = Counter(
    "explicit_outbox_dead_lettered_total",
    "Outbox events sent to the dead letters instead of the broker, by reason.",
    ["task", "reason"],
)
deduplicated = Counter(
    "explicit_outbox_deduplicated_total",
    "Outbox events not published because another message owns their dedup id.",
    ["task"],
)
broker_unavailable = Counter(
    "explicit_outbox_broker_unavailable_total",
    "Batches the relay could not publish because the broker was unreachable; it "
    "backs off and publishes them later.",
)


def serve(port: int) -> str:
    """Serve this process's metrics on ``port``; the address served. Raises OSError
    when it cannot listen."""
    bind = settings.worker_metrics_bind
    worker_metrics.serve(REGISTRY, port=port, bind=bind)
    return f"http://{bind}:{port}/metrics"
