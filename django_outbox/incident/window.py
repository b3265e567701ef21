"""An incident over a time window: which jobs had something unusual, grouped by cause.

The article's first question after an incident is "which orders were affected?". A
job's own page answers it for one job; this answers it for every job of a window, from
the same data: the attempt rows (an error, a retry, a redelivery, a fenced commit, a
conflict, a deferral), the takeovers (``Fence``: a holder that died or whose lease
ran out) and the dead letters. Each group says its cause in the words the lists use,
how many events and how many jobs it holds, and names the first jobs (by their
idempotency key, the business identity), each a link to its timeline.

``manage.py explicit_explain --since 02:50 --until 03:20`` prints it; the admin's window page
shows it. What is not stored as data is not here: a breaker's openings live in Redis
and in the metrics (``explicit_breaker_open``); the jobs the breaker
deferred are here, as deferrals for the downstream.

Cost: one pass over the window's attempt rows that are not plain successes, plus the
window's takeovers and dead letters (``bench/window_million.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, time, timedelta

from django.db.models import Q

from celery_explicit.outcomes import DeadLetterReason, Outcome
from django_outbox import times
from django_outbox.conf import settings
from django_outbox.incident import verdict
from django_outbox.models import Attempt, DeadLetter, Fence

#: Attempt outcomes that are not news: the job did what it was asked, once.
ORDINARY = frozenset({Outcome.APPLIED, Outcome.SUCCEEDED})

#: How many jobs each group names; the counts cover them all.
DEFAULT_LIMIT = 20


@dataclass
class Job:
    """One job of a group: its business identity and how often the cause hit it."""

    key: str
    task_id: str
    task_name: str
    first_at: datetime
    events: int = 0


@dataclass
class Group:
    cause: str
    label: str
    events: int = 0
    jobs: dict[str, Job] = field(default_factory=dict)
    #: Events by the version of the code that wrote them ("" where a row does not say):
    #: "did the deploy cause this?" at a glance.
    versions: Counter[str] = field(default_factory=Counter)

    def add(self, key: str, task_id: str, task_name: str, at: datetime, version: str = "") -> None:
        self.events += 1
        self.versions[version] += 1
        job = self.jobs.get(key or task_id)
        if job is None:
            job = self.jobs[key or task_id] = Job(key or task_id, task_id, task_name, at)
        job.events += 1
        job.first_at = min(job.first_at, at)

    def named(self, limit: int) -> list[Job]:
        """The first ``limit`` jobs, oldest first."""
        return sorted(self.jobs.values(), key=lambda j: j.first_at)[:limit]


@dataclass
class Window:
    since: datetime
    until: datetime
    groups: list[Group]

    @property
    def jobs(self) -> int:
        """Jobs with anything unusual (a job in several groups counts once)."""
        return len({key for group in self.groups for key in group.jobs})

    def as_json(self, limit: int = DEFAULT_LIMIT) -> dict[str, object]:
        return {
            "since": times.iso(self.since),
            "until": times.iso(self.until),
            "jobs": self.jobs,
            "groups": [
                {
                    "cause": g.cause,
                    "label": g.label,
                    "events": g.events,
                    "jobs": len(g.jobs),
                    "versions": dict(g.versions.most_common()),
                    "named": [
                        {
                            "key": j.key,
                            "task_id": j.task_id,
                            "task": j.task_name,
                            "first_at": times.iso(j.first_at),
                            "events": j.events,
                        }
                        for j in g.named(limit)
                    ],
                }
                for g in self.groups
            ],
        }

    def as_text(self, limit: int = DEFAULT_LIMIT) -> str:
        lines = [
            f"from {times.shown(self.since)} to {times.shown(self.until)}: "
            + (
                f"{self.jobs} job(s) with something unusual"
                if self.groups
                else "nothing unusual (no error, retry, redelivery, takeover, fenced "
                "commit, conflict, deferral or dead letter)"
            )
        ]
        for g in self.groups:
            lines.append(f"{g.label}: {g.events} time(s), {len(g.jobs)} job(s)")
            if set(g.versions) != {""}:
                lines.append("  by version: " + _versions_text(g.versions))
            for j in g.named(limit):
                lines.append(
                    f"  {times.shown(j.first_at)}  {j.key}  ({j.task_name}[{j.task_id}]"
                    + (f", {j.events}x" if j.events > 1 else "")
                    + ")"
                )
            if len(g.jobs) > limit:
                lines.append(f"  ... and {len(g.jobs) - limit} more")
        return "\n".join(lines)


def _versions_text(versions: Counter[str]) -> str:
    return ", ".join(f"{v or 'unknown'} {n}x" for v, n in versions.most_common())


def report(since: datetime, until: datetime, *, using: str | None = None) -> Window:
    """Every unusual thing between ``since`` and ``until``, grouped by cause."""
    if until <= since:
        raise ValueError(
            f"the window ends ({times.shown(until)}) before it starts ({times.shown(since)})"
        )
    db = using or settings.database
    groups: dict[str, Group] = {}

    def group(cause: str, label: str) -> Group:
        if cause not in groups:
            groups[cause] = Group(cause, label)
        return groups[cause]

    unusual = (
        Attempt.objects.using(db)
        .filter(started_at__gte=since, started_at__lt=until)
        .filter(
            ~Q(outcome__in=ORDINARY)
            | Q(redelivered=True)
            # Written as NULL when none (and {} by older rows): neither is a deferral.
            | (Q(deferrals__isnull=False) & ~Q(deferrals={}))
        )
        .order_by()
        .values_list(
            "idempotency_key",
            "task_id",
            "task_name",
            "outcome",
            "redelivered",
            "deferrals",
            "started_at",
            "app_version",
        )
    )
    for key, task_id, task_name, outcome, redelivered, deferrals, at, version in unusual.iterator(
        chunk_size=5000
    ):
        job = (key, task_id, task_name, at, version)
        if outcome not in ORDINARY:
            group(f"outcome:{outcome}", Outcome(outcome).label).add(*job)
        if redelivered:
            group("redelivered", "redelivered by the broker").add(*job)
        for why in deferrals or {}:
            label = f"deferred: {verdict.DEFERRALS.get(why, why)}"
            group(f"deferred:{why}", label).add(*job)

    takeovers = (
        Fence.objects.using(db)
        .filter(taken_over_at__gte=since, taken_over_at__lt=until)
        .exclude(taken_over_from="")  # a redelivery's fence: counted as a redelivery
        .values_list("idempotency_key", "task_id", "cause", "taken_over_at")
    )
    names = _task_names(db, (t[1] for t in takeovers))
    for key, task_id, cause, at in takeovers:
        label = f"taken over {verdict.CAUSES.get(cause, cause)}"
        group(f"takeover:{cause}", label).add(key, task_id, names.get(task_id, "?"), at)

    letters = (
        DeadLetter.objects.using(db)
        .filter(first_seen__gte=since, first_seen__lt=until)
        .values_list(
            "idempotency_key", "task_id", "task_name", "reason", "first_seen", "app_version"
        )
    )
    for key, task_id, task_name, reason, at, version in letters:
        label = f"dead-lettered: {_reason_label(reason)}"
        group(f"dead_letter:{reason}", label).add(key, task_id, task_name, at, version)

    ordered = sorted(groups.values(), key=lambda g: (-len(g.jobs), g.label))
    return Window(since, until, ordered)


def _task_names(db: str, task_ids: Iterable[str]) -> dict[str, str]:
    """A takeover's row names no task: its attempts do."""
    ids = list(task_ids)
    if not ids:
        return {}
    rows = Attempt.objects.using(db).filter(task_id__in=ids).values_list("task_id", "task_name")
    return dict(rows)


def _reason_label(reason: str) -> str:
    try:
        return str(DeadLetterReason(reason).label)
    except ValueError:
        return reason


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """``--since``/``--until``: an ISO 8601 time (``2026-12-02T02:50``, with or without an
    offset: UTC when none), or a time of day (``02:50``, ``02:50:30``, UTC), the last
    one not in the future. A clear error otherwise."""
    now = now or datetime.now(UTC)
    value = text.strip()
    try:
        of_day = time.fromisoformat(value)
    except ValueError:
        of_day = None
    if of_day is not None and len(value) <= 15:
        at = datetime.combine(now.date(), of_day.replace(tzinfo=None), tzinfo=UTC)
        return at - timedelta(days=1) if at > now else at
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: give an ISO 8601 time (2026-12-02T02:50, UTC unless "
            "it carries an offset) or a time of day in UTC (02:50)"
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
