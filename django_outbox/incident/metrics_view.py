"""What the database and the broker know, as Prometheus gauges read at scrape time.

A worker's endpoint (``celery_explicit.worker_metrics``) counts what its processes
did; some questions only the stored state answers, whoever runs and whatever crashed:
how many dead letters are open and for how long, how far the outbox is behind (a
gauge that rises while events wait, whether or not a relay runs), how many messages
wait in each queue and since when. This view reads them on each scrape: one
aggregate over the dead letters, one over the pending outbox events (both through
their indexes), and one passive declare per queue.

Turned on by ``EXPLICIT_METRICS_TOKEN``: unset, the view answers 404; a request
without ``Authorization: Bearer <token>`` gets 401, a wrong token 403.

A broker that cannot be reached is a scrape without its gauges and
``explicit_metrics_source_up{source="broker"} 0``. A source that answers with a
refusal (Redis: an ACL without the permission, a wrong password, any error reply;
the database: any ``DatabaseError``) is a 503 naming the source and the error, and
one log line: a scrape that fails says so instead of answering 500. It is routed
under the admin (``/admin/django_outbox/dashboard/metrics/``, by ``DashboardAdmin``,
outside the admin's login) and importable for a route of your own (``metrics_view``).
No label carries an argument, a payload or an idempotency key: reasons, queue names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from django.db import DatabaseError
from django.db.models import Count, Min
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError

from celery_explicit.worker_metrics import bearer_refusal
from django_outbox import broker_queues
from django_outbox.conf import settings
from django_outbox.models import DeadLetter, DeadLetterReason, DeadLetterStatus, OutboxEvent

__all__ = ["StoredStateCollector", "metrics_view"]

logger = logging.getLogger("django_outbox.incident.metrics_view")
#: Redis errors that are an answer, not a lost connection: kombu wraps some of them in
#: its OperationalError (a wrong password is a redis ConnectionError).
REDIS_REFUSALS = (ResponseError, AuthenticationError, AuthorizationError)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The exposition of ``StoredStateCollector``, behind ``EXPLICIT_METRICS_TOKEN``."""
    token = settings.metrics_token
    if not token:
        raise Http404("EXPLICIT_METRICS_TOKEN is not set")
    refused = bearer_refusal(request.headers.get("Authorization", ""), token)
    if refused is not None:
        status, text = refused
        response = HttpResponse(text, status=status, content_type="text/plain")
        if status == 401:
            response["WWW-Authenticate"] = "Bearer"
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoredStateCollector())
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    try:
        body = encoder(registry)
    except SourceRefused as exc:
        logger.error("metrics scrape failed: %s", exc)
        return HttpResponse(f"{exc}\n", status=503, content_type="text/plain")
    return HttpResponse(body, content_type=content_type)


class SourceRefused(Exception):
    """A source of the scrape answered with an error (internal: the view's 503)."""

    def __init__(self, source: str, error: BaseException) -> None:
        super().__init__(f"the {source} refused the metrics query: {type(error).__name__}: {error}")
        self.source = source


class StoredStateCollector(Collector):
    """Gauges from the database and the broker, read when collected."""

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "explicit_metrics_source_up",
            "1 if this scrape could read the source (database, broker), else 0: the "
            "source's gauges are missing from a scrape that could not read it.",
            labels=["source"],
        )
        try:
            database = _database_gauges()
        except DatabaseError as exc:
            raise SourceRefused("database", exc) from exc
        yield from database
        up.add_metric(["database"], 1)
        try:
            states = broker_queues.queue_states(settings.celery_app())
        except RedisError as exc:
            raise SourceRefused("broker", exc) from exc
        except (OperationalError, OSError) as exc:
            refusal = _redis_refusal(exc)
            if refusal is not None:
                raise SourceRefused("broker", refusal) from exc
            up.add_metric(["broker"], 0)
        else:
            yield from _queue_gauges(states)
            up.add_metric(["broker"], 1)
        yield up


def _redis_refusal(exc: BaseException) -> BaseException | None:
    """The Redis refusal behind a connection error kombu raised, if one is."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, REDIS_REFUSALS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _database_gauges() -> list[Metric]:
    # Built in full before anything is yielded: a database error mid-way must not
    # leave half a family in the scrape.
    now = timezone.now()
    open_letters = GaugeMetricFamily(
        "explicit_dead_letters_open",
        "Dead letters waiting for a decision (status open), by reason.",
        labels=["reason"],
    )
    oldest_letter = GaugeMetricFamily(
        "explicit_dead_letters_oldest_open_age_seconds",
        "Age of the oldest open dead letter (since its first_seen), by reason; 0 when "
        "none is open.",
        labels=["reason"],
        unit="seconds",
    )
    found = {
        row["reason"]: row
        for row in DeadLetter.objects.using(settings.database)
        .filter(status=DeadLetterStatus.OPEN)
        .values("reason")
        .annotate(n=Count("id"), oldest=Min("first_seen"))
    }
    # Every reason, 0 included: an alert on a series that appears only once it is
    # non-zero cannot tell "none" from "not scraped".
    for reason in sorted({*DeadLetterReason.values, *found}):
        row = found.get(reason)
        open_letters.add_metric([reason], row["n"] if row else 0)
        age = (now - row["oldest"]).total_seconds() if row else 0.0
        oldest_letter.add_metric([reason], max(0.0, age))
    count, oldest = OutboxEvent.objects.using(settings.database).backlog()
    backlog = GaugeMetricFamily(
        "explicit_outbox_backlog",
        "Outbox events written and not yet published (status pending).",
        value=count,
    )
    lag = GaugeMetricFamily(
        "explicit_outbox_lag_seconds",
        "Age of the oldest pending outbox event: rises while events wait, whether or "
        "not a relay runs; 0 when none waits.",
        value=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
        unit="seconds",
    )
    return [open_letters, oldest_letter, backlog, lag]


def _queue_gauges(states: Iterable[broker_queues.QueueState]) -> list[Metric]:
    depth = GaugeMetricFamily(
        "explicit_queue_depth",
        "Messages waiting in a queue the app knows (not those held by a worker).",
        labels=["queue"],
    )
    oldest = GaugeMetricFamily(
        "explicit_queue_oldest_message_age_seconds",
        "Age of the message that has waited longest in a queue, from its publish time "
        "(Redis: the explicit_sent_at header; RabbitMQ: the management API's "
        "head_message_timestamp); 0 when empty, absent when it cannot be read.",
        labels=["queue"],
        unit="seconds",
    )
    for state in states:
        depth.add_metric([state.name], state.depth)
        if state.oldest_age is not None:
            oldest.add_metric([state.name], state.oldest_age)
    return [depth, oldest]
