"""The dashboard: how the jobs are doing now, on one staff page, from our own data.

Per time bucket over the last hour (or 6 h, 24 h): attempts by outcome and dead-letter
inflow by reason, in the lists' own words, every plot of a window on one time axis
(labelled ticks in UTC, as ``times.shown`` writes every time): the same minute is at
the same x in every plot. Each bar's tooltip says its minutes and its count, and the
bar links to the admin list of those attempts or dead letters (a time-range filter).
Then the open dead letters by reason with the oldest of each; live: each known queue's
depth on the broker with the messages workers hold unacknowledged (prefetched,
reserved, running) and the age of its oldest message (Redis), the outbox's backlog,
oldest pending event and publish lag, open circuit breakers, running execution leases,
and lease locks held longer than their TTL. Plots are SVG drawn here (no script, no
network). Every count is one query through an index (``outcome, started_at`` for
attempts): it stays fast on a million rows (docs/performance.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import Avg, Count, F, Min
from django.db.models.functions import Trunc
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from kombu.exceptions import OperationalError

from celery_explicit.outcomes import Outcome
from django_outbox import broker_queues, times
from django_outbox.conf import settings
from django_outbox.models import (
    Attempt,
    DeadLetter,
    DeadLetterReason,
    DeadLetterStatus,
    OutboxEvent,
    OutboxStatus,
)

#: Window (hours) -> bucket size (minutes): about 60 bars whatever the window.
WINDOWS = {1: 1, 6: 5, 24: 15}
#: Window (hours) -> minutes between labelled ticks on its time axis.
TICKS = {1: 10, 6: 60, 24: 180}

#: Every plot and the axis share these: the same bucket is at the same x everywhere.
WIDTH = 600
HEIGHT = 48
AXIS_HEIGHT = 24

#: A bar's link: the admin list of what it counts, from ``start`` to ``end``.
Link = Callable[[datetime, datetime], str]


@dataclass
class Axis:
    """The buckets of a window and where each is drawn."""

    buckets: list[datetime]
    minutes: int
    tick_minutes: int

    @property
    def step(self) -> float:
        return WIDTH / max(1, len(self.buckets))

    def x(self, index: int) -> float:
        return index * self.step

    def ticks(self) -> list[tuple[float, datetime]]:
        """(x, time) of each labelled tick: bucket starts on a whole tick interval."""
        return [
            (self.x(i), b)
            for i, b in enumerate(self.buckets)
            if (b.hour * 60 + b.minute) % self.tick_minutes == 0
        ]

    def svg(self) -> SafeString:
        """The axis under the plots: a tick and its time (HH:MM UTC) every interval."""
        marks = format_html_join(
            "",
            '<line x1="{0}" y1="0" x2="{0}" y2="5"></line>'
            '<text x="{0}" y="17" text-anchor="middle">{1}</text>',
            ((f"{x:.1f}", at.strftime("%H:%M")) for x, at in self.ticks()),
        )
        return format_html(
            '<svg class="axis" width="{}" height="{}" viewBox="0 0 {} {}" role="img" '
            'aria-label="time, UTC" overflow="visible"><line x1="0" y1="0" x2="{}" y2="0">'
            '</line>{}<text class="unit" x="{}" y="17" text-anchor="start">UTC</text></svg>',
            WIDTH,
            AXIS_HEIGHT,
            WIDTH,
            AXIS_HEIGHT,
            WIDTH,
            marks,
            WIDTH + 6,
        )


@dataclass
class Series:
    label: str
    total: int
    peak: int
    svg: SafeString


def dashboard_view(model_admin: Any, request: HttpRequest) -> TemplateResponse:
    try:
        hours = int(request.GET.get("hours", "1"))
    except ValueError:
        hours = 1
    hours = hours if hours in WINDOWS else 1
    now = timezone.now()
    since = now - timedelta(hours=hours)
    axis = Axis(_buckets(since, now, WINDOWS[hours]), WINDOWS[hours], TICKS[hours])
    site = model_admin.admin_site.name
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Explicit jobs: dashboard",
        "hours": hours,
        "windows": list(WINDOWS),
        "bucket_minutes": WINDOWS[hours],
        "axis": axis.svg(),
        "attempts": _attempt_series(since, axis, site),
        "dead_letters": _dead_letter_series(since, axis, site),
        "open_letters": open_dead_letters(now, site),
        "outbox": _outbox(now, since),
        "missed_slots": _missed_slots(now, hours),
        "live": _live(),
        "opts": model_admin.model._meta,
    }
    return TemplateResponse(request, "admin/django_outbox/dashboard.html", context)


def _buckets(since: datetime, now: datetime, minutes: int) -> list[datetime]:
    # In UTC, as the axis is labelled: a zone's offset of half an hour would otherwise
    # move every bucket's boundary.
    start = since.astimezone(UTC).replace(second=0, microsecond=0)
    start -= timedelta(minutes=start.minute % minutes)
    out = []
    while start <= now:
        out.append(start)
        start += timedelta(minutes=minutes)
    return out


def _bucket_of(at: datetime, minutes: int) -> datetime:
    at = at.astimezone(UTC).replace(second=0, microsecond=0)
    return at - timedelta(minutes=at.minute % minutes)


def _changelist(site: str, model: str, params: dict[str, str]) -> str:
    return f"{reverse(f'{site}:django_outbox_{model}_changelist')}?{urlencode(params)}"


def _range(field: str, start: datetime, end: datetime) -> dict[str, str]:
    return {f"{field}__gte": start.isoformat(), f"{field}__lt": end.isoformat()}


def _attempt_series(since: datetime, axis: Axis, site: str = "admin") -> list[Series]:
    rows = Attempt.objects.using(settings.database)
    series = []
    # One query per outcome: each is a range scan of the (outcome, started_at) index.
    for outcome in Outcome:
        counts: dict[datetime, int] = defaultdict(int)
        for row in (
            rows.filter(outcome=outcome, started_at__gte=since)
            .annotate(minute=Trunc("started_at", "minute", tzinfo=UTC))
            .values("minute")
            .annotate(n=Count("id"))
        ):
            counts[_bucket_of(row["minute"], axis.minutes)] += row["n"]
        if counts:

            def link(start: datetime, end: datetime, value: str = outcome.value) -> str:
                return _changelist(
                    site, "attempt", {"outcome__exact": value, **_range("started_at", start, end)}
                )

            series.append(_series(str(outcome.label), counts, axis, link))
    return series


def _dead_letter_series(since: datetime, axis: Axis, site: str = "admin") -> list[Series]:
    counts: dict[str, dict[datetime, int]] = defaultdict(lambda: defaultdict(int))
    for row in (
        DeadLetter.objects.using(settings.database)
        .filter(first_seen__gte=since)
        .annotate(minute=Trunc("first_seen", "minute", tzinfo=UTC))
        .values("reason", "minute")
        .annotate(n=Count("id"))
    ):
        counts[row["reason"]][_bucket_of(row["minute"], axis.minutes)] += row["n"]
    series = []
    for reason, per in sorted(counts.items()):

        def link(start: datetime, end: datetime, value: str = reason) -> str:
            # Every status: the plot counts what arrived, whatever became of it since.
            params = {"status": "every", "reason__exact": value}
            return _changelist(site, "deadletter", {**params, **_range("first_seen", start, end)})

        series.append(_series(reason_words(reason), per, axis, link))
    return series


def reason_words(reason: str) -> str:
    """A dead letter's reason as the lists write it (``bad_input`` -> "bad input")."""
    try:
        return str(DeadLetterReason(reason).label)
    except ValueError:
        return reason


def _series(label: str, counts: dict[datetime, int], axis: Axis, link: Link) -> Series:
    values = [counts.get(b, 0) for b in axis.buckets]
    return Series(
        label=label, total=sum(values), peak=max(values), svg=_bars(label, values, axis, link)
    )


def _bars(label: str, values: list[int], axis: Axis, link: Link) -> SafeString:
    """A bar per bucket, scaled to the largest, at the axis's x for its bucket; drawn
    here, no script. Each bucket's whole height is its hover target (a bar of 1 among
    hundreds is a pixel high): the tooltip names its minutes and its count, and a
    bucket with a count links to the list of what it counts."""
    peak = max(values) or 1
    width = max(1.0, axis.step - 1)
    grid = format_html_join(
        "",
        '<line class="grid" x1="{0}" y1="0" x2="{0}" y2="{1}"></line>',
        ((f"{x:.1f}", HEIGHT) for x, _ in axis.ticks()),
    )
    parts = []
    for i, (start, value) in enumerate(zip(axis.buckets, values, strict=True)):
        end = start + timedelta(minutes=axis.minutes)
        x = f"{axis.x(i):.1f}"
        minute = start.strftime("%Y-%m-%d %H:%M")
        tip = f"{minute}\u2013{end:%H:%M} UTC: {value} {label}"
        bar = format_html(
            '<title>{}</title><rect class="hit" x="{}" y="0" width="{}" height="{}"></rect>'
            '<rect class="bar" x="{}" y="{}" width="{}" height="{}"></rect>',
            tip,
            x,
            f"{axis.step:.1f}",
            HEIGHT,
            x,
            f"{HEIGHT - value / peak * HEIGHT:.1f}",
            f"{width:.1f}",
            f"{value / peak * HEIGHT:.1f}",
        )
        if value:
            parts.append(
                format_html(
                    '<a class="bucket" href="{}" data-minute="{}" data-count="{}">{}</a>',
                    link(start, end),
                    minute,
                    value,
                    bar,
                )
            )
        else:
            parts.append(format_html('<g class="bucket" data-minute="{}">{}</g>', minute, bar))
    return format_html(
        '<svg class="bars" width="{}" height="{}" viewBox="0 0 {} {}" role="img">{}{}</svg>',
        WIDTH,
        HEIGHT,
        WIDTH,
        HEIGHT,
        grid,
        mark_safe("".join(parts)),  # each part escaped by format_html above
    )


def open_dead_letters(now: datetime, site: str = "admin") -> dict[str, Any]:
    """The open dead letters by reason, with the oldest of each: what waits for a
    person, however long ago it arrived (the plots show only the window)."""
    rows = (
        DeadLetter.objects.using(settings.database)
        .filter(status=DeadLetterStatus.OPEN)
        .values("reason")
        .annotate(n=Count("id"), oldest=Min("first_seen"))
        .order_by("oldest")
    )
    reasons = [
        {
            "reason": reason_words(row["reason"]),
            "count": row["n"],
            "oldest": times.shown(row["oldest"]),
            "oldest_age": age_text((now - row["oldest"]).total_seconds()),
            "url": _changelist(site, "deadletter", {"reason__exact": row["reason"]}),
        }
        for row in rows
    ]
    return {"total": sum(r["count"] for r in reasons), "reasons": reasons}


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


def _missed_slots(now: datetime, hours: int) -> list[dict[str, Any]]:
    """Periodic entries with slots in the window that no beat published (W016's
    reading, over the dashboard's window)."""
    from celery_explicit import periodic
    from django_outbox.store import periodic_slots

    return [
        {
            "entry": gap.entry,
            "task": gap.task_name,
            "count": len(gap.slots),
            "first": periodic.format_slot(gap.slots[0]),
        }
        for gap in periodic_slots.missing(now=now, window=hours * 3600.0)
    ]


def _live() -> dict[str, Any]:
    """From Redis and the broker; what cannot be read is said, not hidden."""
    import redis

    from celery_explicit import downstream, execution_lease, locks, rate_limit, redis_state

    live: dict[str, Any] = {
        "error": "",
        "breakers": [],
        "leases": 0,
        "locks": [],
        "queues": [],
        "rate_limited": [],
    }
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
        live["rate_limited"] = [
            {"key": key, "seconds": ahead}
            for key, ahead in sorted(rate_limit.limited_keys(client), key=lambda kv: -kv[1])
        ][:20]
        live["queues"] = _queue_depths(app)
    except (redis.RedisError, OSError, OperationalError) as exc:
        live["error"] = f"Redis or the broker could not be read: {exc}"
    return live


def _queue_depths(app: Any) -> list[dict[str, Any]]:
    """Each queue the app knows, in words (``django_outbox.broker_queues`` reads them): its
    messages in all, those waiting in it and those workers hold unacknowledged
    (prefetched, reserved or running: a queue of 0 can have jobs waiting in a worker
    for a free process), and the age of the oldest waiting one."""
    shown = []
    for q in broker_queues.queue_states(app):
        if q.unacked is None:
            text = f"{q.name}: {q.depth} waiting, held by workers unknown ({q.unacked_why})"
        else:
            text = (
                f"{q.name}: {q.depth + q.unacked} in all ({q.depth} waiting, "
                f"{q.unacked} held by workers)"
            )
        oldest = age_text(q.oldest_age) if q.oldest_age is not None and q.depth else q.why
        shown.append({"name": q.name, "text": f"{text}, oldest {oldest}" if oldest else text})
    return shown


def age_text(seconds: float) -> str:
    """An age as a person reads it: 4.2s, 12min, 3.5h, 2.0d."""
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
