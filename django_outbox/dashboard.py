"""The dashboard: how the jobs are doing now, on one staff page, from our own data.

Per time bucket over the last hour (or 6 h, 24 h): attempts by outcome, retries, fenced
commits, dead-letter inflow by reason. Live: each known queue's depth on the broker and
the age of its oldest message (Redis), the outbox's backlog, oldest pending event and
publish lag, open circuit breakers, running execution leases, and lease locks held
longer than their TTL. Plots are SVG drawn here (no script, no network). Every count
is one query through an index (``outcome, started_at`` for attempts): it stays fast on
a million rows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Avg, Count, F, Min
from django.db.models.functions import Trunc
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from kombu.exceptions import OperationalError

from celery_explicit.outcomes import Outcome
from django_outbox import queues
from django_outbox.conf import settings
from django_outbox.models import Attempt, DeadLetter, OutboxEvent, OutboxStatus

#: Window (hours) -> bucket size (minutes): about 60 bars whatever the window.
WINDOWS = {1: 1, 6: 5, 24: 15}


@dataclass
class Series:
    label: str
    total: int
    svg: SafeString


def dashboard_view(model_admin: Any, request: HttpRequest) -> TemplateResponse:
    try:
        hours = int(request.GET.get("hours", "1"))
    except ValueError:
        hours = 1
    hours = hours if hours in WINDOWS else 1
    now = timezone.now()
    since = now - timedelta(hours=hours)
    buckets = _buckets(since, now, WINDOWS[hours])
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Explicit jobs: dashboard",
        "hours": hours,
        "windows": list(WINDOWS),
        "attempts": _attempt_series(since, buckets, WINDOWS[hours]),
        "dead_letters": _dead_letter_series(since, buckets, WINDOWS[hours]),
        "outbox": _outbox(now, since),
        "live": _live(),
        "opts": model_admin.model._meta,
    }
    return TemplateResponse(request, "admin/django_outbox/dashboard.html", context)


def _buckets(since: datetime, now: datetime, minutes: int) -> list[datetime]:
    start = since.replace(second=0, microsecond=0)
    start -= timedelta(minutes=start.minute % minutes)
    out = []
    while start <= now:
        out.append(start)
        start += timedelta(minutes=minutes)
    return out


def _bucket_of(at: datetime, minutes: int) -> datetime:
    at = at.replace(second=0, microsecond=0)
    return at - timedelta(minutes=at.minute % minutes)


def _attempt_series(since: datetime, buckets: list[datetime], minutes: int) -> list[Series]:
    rows = Attempt.objects.using(settings.database)
    series = []
    # One query per outcome: each is a range scan of the (outcome, started_at) index.
    for outcome in Outcome:
        counts: dict[datetime, int] = defaultdict(int)
        for row in (
            rows.filter(outcome=outcome, started_at__gte=since)
            .annotate(minute=Trunc("started_at", "minute"))
            .values("minute")
            .annotate(n=Count("id"))
        ):
            counts[_bucket_of(row["minute"], minutes)] += row["n"]
        if counts:
            series.append(_series(outcome.label, counts, buckets))
    return series


def _dead_letter_series(since: datetime, buckets: list[datetime], minutes: int) -> list[Series]:
    counts: dict[str, dict[datetime, int]] = defaultdict(lambda: defaultdict(int))
    for row in (
        DeadLetter.objects.using(settings.database)
        .filter(first_seen__gte=since)
        .annotate(minute=Trunc("first_seen", "minute"))
        .values("reason", "minute")
        .annotate(n=Count("id"))
    ):
        counts[row["reason"]][_bucket_of(row["minute"], minutes)] += row["n"]
    return [_series(reason, per, buckets) for reason, per in sorted(counts.items())]


def _series(label: str, counts: dict[datetime, int], buckets: list[datetime]) -> Series:
    values = [counts.get(b, 0) for b in buckets]
    return Series(label=str(label), total=sum(values), svg=_bars(values))


def _bars(values: list[int], width: int = 600, height: int = 48) -> SafeString:
    """A bar per bucket, scaled to the largest; drawn here, no script."""
    peak = max(values) or 1
    step = width / max(1, len(values))
    bars = format_html_join(
        "",
        '<rect x="{}" y="{}" width="{}" height="{}"><title>{}</title></rect>',
        (
            (
                f"{i * step:.1f}",
                f"{height - v / peak * height:.1f}",
                f"{max(1.0, step - 1):.1f}",
                f"{v / peak * height:.1f}",
                v,
            )
            for i, v in enumerate(values)
        ),
    )
    return format_html(
        '<svg class="bars" width="{}" height="{}" viewBox="0 0 {} {}" role="img">{}</svg>',
        width,
        height,
        width,
        height,
        bars,
    )


def _outbox(now: datetime, since: datetime) -> dict[str, Any]:
    events = OutboxEvent.objects.using(settings.database)
    pending = events.filter(status=OutboxStatus.PENDING)
    oldest = pending.aggregate(oldest=Min("created_at"))["oldest"]
    lag = (
        events.filter(published_at__gte=since)
        .aggregate(lag=Avg(F("published_at") - F("created_at")))
        .get("lag")
    )
    return {
        "backlog": pending.count(),
        "oldest_age": (now - oldest).total_seconds() if oldest else None,
        "publish_lag": lag.total_seconds() if lag is not None else None,
    }


def _live() -> dict[str, Any]:
    """From Redis and the broker; what cannot be read is said, not hidden."""
    import redis

    from celery_explicit import downstream, execution_lease, locks, redis_state

    live: dict[str, Any] = {"error": "", "breakers": [], "leases": 0, "locks": [], "queues": []}
    try:
        client = redis_state.client()
        live["leases"] = len(execution_lease.live_executions(client))
        live["locks"] = [lock for lock in locks.live_locks(client) if lock.age > 60]
        app = settings.celery_app()
        contracts = [getattr(t, "contract", None) for t in app.tasks.values()]
        declared = {
            c.downstream.name: c.downstream
            for c in contracts
            if c is not None and c.downstream is not None
        }
        for name, declared_downstream in sorted(declared.items()):
            info = downstream.state(declared_downstream)
            if info["state"] != downstream.BreakerState.CLOSED:
                live["breakers"].append({"name": name, **info})
        live["queues"] = _queue_depths(app)
    except (redis.RedisError, OSError, OperationalError) as exc:
        live["error"] = f"Redis or the broker could not be read: {exc}"
    return live


def _queue_depths(app: Any) -> list[dict[str, Any]]:
    """Messages waiting in each queue the app knows, and the age of the oldest, in
    words (``django_outbox.queues`` reads them)."""
    return [
        {
            "name": q.name,
            "depth": q.depth,
            "oldest": (age_text(q.oldest_age) if q.oldest_age is not None and q.depth else q.why),
        }
        for q in queues.queue_states(app)
    ]


def age_text(seconds: float) -> str:
    """An age as a person reads it: 4.2s, 12min, 3.5h, 2.0d."""
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
