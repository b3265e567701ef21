"""Periodic jobs: each schedule slot published once, whatever number of beats run.

Two ``celery beat`` processes running at once (a deploy that starts the new one before
stopping the old, two hosts configured alike) each publish every due entry: every job
twice. Our schedulers (``celery_explicit.beat``) name each due run by its **slot**, the
time the entry was due, and claim ``(entry, slot)`` in the state store before they
publish: the first beat to claim it publishes, a second one drops its copy and leaves a
trace (an attempt row with outcome ``deduplicated``, a log line, a metric). The slot
travels with the message (the ``explicit_slot`` header) and, for a task that declares

    class DailyReport(ExplicitTask):
        periodic = True
        idempotency_key = "report:{slot}"

        def run(self, slot: str) -> None: ...

as its ``slot`` argument, so the idempotency key names the slot: even a message the
claim did not stop (the state store lost, a beat with a very wrong clock) applies its
effect once per slot. A task that declares ``periodic = True`` must take ``slot``.

What a slot is, so that two beats that never spoke agree on it:

- **crontab**: the due minute, the latest time at or before now that the crontab
  matches (in the schedule's timezone);
- **interval** (``schedule(run_every)``, a number of seconds, a ``timedelta``): the
  latest multiple of ``run_every`` since the Unix epoch. Beat's own interval runs count
  from when that beat started; ours run on this grid, so every beat's run falls in the
  same slot (``beat.SlotClaims`` aligns them);
- anything else (solar, clocked, a schedule of your own): the due minute.

A slot is written in ISO 8601's basic format, UTC, to the second: ``20250601T100000Z``
(no ``:``, so it reads as one part of a ``:``-separated key). ``slot_time`` reads it.

State in Redis (``EXPLICIT_REDIS_URL``): ``{prefix}periodic:{<entry>}:<slot>``, holding
``<task id>|<host>`` for ``claim_ttl`` (twice the schedule's period, at least
``MIN_CLAIM_TTL``): long enough that a second beat due in the same slot finds it.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from celery_explicit import job_log, keys, metrics, redis_state
from celery_explicit.redis_scripts import CLAIM_IF_FREE, RELEASE_IF_MINE, call, tagged
from celery_explicit.redis_state import text

__all__ = [
    "MIN_CLAIM_TTL",
    "SLOT_PARAMETER",
    "Claim",
    "Grid",
    "claim",
    "claim_key",
    "declared",
    "format_slot",
    "grid_of",
    "key_uses_slot",
    "release",
    "slot_time",
]

logger = job_log.get_logger("celery_explicit.periodic")

#: The ``run()`` parameter a periodic task's slot is passed as.
SLOT_PARAMETER = "slot"
#: The shortest time a claim is kept: a beat restarting, or a clock a little behind,
#: must still find the slot its twin published.
MIN_CLAIM_TTL = 300.0
#: How far back a crontab's latest slot is looked for (a "29 February" crontab).
_CRON_LOOKBACK_DAYS = 8 * 366
_SLOT_FORMAT = "%Y%m%dT%H%M%SZ"


def declared(
    cls: type, params: tuple[str, ...], takes_kwargs: bool, refuse: Callable[[str, str], Exception]
) -> bool:
    """``periodic``: True or False (the default); True needs a ``slot`` parameter."""
    value = getattr(cls, "periodic", False)
    if not isinstance(value, bool):
        raise refuse(f"periodic={value!r} must be True or False", "periodic")
    if value and SLOT_PARAMETER not in params and not takes_kwargs:
        raise refuse(
            "periodic = True, but run() takes no 'slot' parameter: the scheduler passes "
            "each job its schedule slot (e.g. '20250601T100000Z') as slot=; declare "
            "run(self, slot: str, ...) and key the effect by it "
            "(idempotency_key = '<name>:{slot}')",
            "periodic",
        )
    return value


def key_uses_slot(declaration: keys.KeyDeclaration) -> bool:
    """Does this key name the slot (a template field, or a key callable's parameter)?"""
    if isinstance(declaration, str):
        try:
            return SLOT_PARAMETER in keys.template_fields(declaration)
        except ValueError:
            return False
    names, _takes_kwargs = keys.callable_fields(declaration)
    return SLOT_PARAMETER in names


def format_slot(at: dt.datetime) -> str:
    """``20250601T100000Z``: the slot's UTC time, to the second."""
    return at.astimezone(dt.UTC).strftime(_SLOT_FORMAT)


def slot_time(slot: str) -> dt.datetime:
    """The aware UTC time a slot names (``ValueError`` if it names none)."""
    return dt.datetime.strptime(slot, _SLOT_FORMAT).replace(tzinfo=dt.UTC)


# --- the grid of a schedule: its slots --------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """Where a schedule's slots fall. ``kind``: ``interval`` (``every`` seconds since
    the epoch), ``crontab`` (its five fields and timezone) or ``minute`` (anything else:
    the due minute, and no expectation of which slots come)."""

    kind: str
    every: float = 0.0
    cron: tuple[str, str, str, str, str] = ("", "", "", "", "")
    timezone: str = "UTC"

    def describe(self) -> str:
        """How the slot records store it: ``every 60s``, ``crontab 0 * * * * UTC``."""
        if self.kind == "interval":
            return f"every {self.every:g}s"
        if self.kind == "crontab":
            return f"crontab {' '.join(self.cron)} {self.timezone}"
        return "other"

    @classmethod
    def parse(cls, text_: str) -> Grid:
        parts = text_.split()
        if len(parts) == 2 and parts[0] == "every" and parts[1].endswith("s"):
            return cls("interval", every=float(parts[1][:-1]))
        if len(parts) == 7 and parts[0] == "crontab":
            cron = (parts[1], parts[2], parts[3], parts[4], parts[5])
            return cls("crontab", cron=cron, timezone=parts[6])
        return cls("minute")

    def period(self, now: dt.datetime) -> float:
        """Seconds from the slot of ``now`` to the next one (a minute where unknown)."""
        if self.kind == "interval":
            return self.every
        if self.kind == "crontab":
            current = self.slot_at(now)
            following = _cron_minute(self._crontab(), self._tz(), current, step=1)
            if following is not None:
                return (following - current).total_seconds()
        return 60.0

    def slot_at(self, now: dt.datetime) -> dt.datetime:
        """The slot a run due at ``now`` belongs to (an aware UTC time)."""
        now = now.astimezone(dt.UTC)
        if self.kind == "interval":
            stamp = math.floor(now.timestamp() / self.every) * self.every
            return dt.datetime.fromtimestamp(stamp, dt.UTC)
        if self.kind == "crontab":
            found = _cron_minute(self._crontab(), self._tz(), now, step=-1)
            if found is not None:
                return found
        return now.replace(second=0, microsecond=0)

    def slots_between(self, start: dt.datetime, end: dt.datetime) -> Iterator[dt.datetime]:
        """The slots from ``start`` to ``end`` (both included), in order; none for a grid
        of kind ``minute``, whose slots cannot be foreseen."""
        start, end = start.astimezone(dt.UTC), end.astimezone(dt.UTC)
        if self.kind == "interval":
            stamp = math.ceil(start.timestamp() / self.every) * self.every
            while stamp <= end.timestamp():
                yield dt.datetime.fromtimestamp(stamp, dt.UTC)
                stamp += self.every
        elif self.kind == "crontab":
            cron, tz = self._crontab(), self._tz()
            found = _cron_minute(cron, tz, start - dt.timedelta(microseconds=1), step=1)
            while found is not None and found <= end:
                yield found
                found = _cron_minute(cron, tz, found, step=1)

    def _crontab(self) -> Any:
        from celery.schedules import crontab

        minute, hour, day_of_month, month_of_year, day_of_week = self.cron
        return crontab(
            minute=minute,
            hour=hour,
            day_of_month=day_of_month,
            month_of_year=month_of_year,
            day_of_week=day_of_week,
        )

    def _tz(self) -> dt.tzinfo:
        from zoneinfo import ZoneInfo

        return ZoneInfo(self.timezone)


def grid_of(schedule: Any) -> Grid:
    """The grid of a beat entry's schedule (Celery's or django-celery-beat's)."""
    from celery.schedules import crontab, solar
    from celery.schedules import schedule as interval

    if isinstance(schedule, crontab):
        # celery-types leaves out crontab's fields: read as Any.
        found: Any = schedule
        tz = found.tz
        return Grid(
            "crontab",
            cron=(
                _cron_field(found._orig_minute, found.minute),
                _cron_field(found._orig_hour, found.hour),
                _cron_field(found._orig_day_of_month, found.day_of_month),
                _cron_field(found._orig_month_of_year, found.month_of_year),
                _cron_field(found._orig_day_of_week, found.day_of_week),
            ),
            timezone=str(getattr(tz, "key", None) or tz),
        )
    # crontab and solar subclass schedule: what is left is an interval.
    if isinstance(schedule, interval) and not isinstance(schedule, solar):
        run_every: Any = schedule.__dict__.get("run_every")
        every = float(run_every.total_seconds()) if run_every is not None else 0.0
        if every > 0:
            return Grid("interval", every=every)
    return Grid("minute")


def _cron_field(original: Any, expanded: set[int]) -> str:
    """A crontab field as text crontab() reads again: as written, or its values."""
    if isinstance(original, str) and original.strip() and " " not in original.strip():
        return original.strip()
    return ",".join(str(value) for value in sorted(expanded))


def _cron_day_matches(cron: Any, day: dt.date) -> bool:
    # Celery's day_of_week counts from Sunday = 0; isoweekday from Monday = 1.
    return (
        day.day in cron.day_of_month
        and day.month in cron.month_of_year
        and day.isoweekday() % 7 in cron.day_of_week
    )


def _cron_minute(cron: Any, tz: dt.tzinfo, at: dt.datetime, *, step: int) -> dt.datetime | None:
    """The crontab's minute nearest ``at``: the latest at or before it (``step=-1``),
    or the first strictly after it (``step=1``), in UTC. Walked day by day, then the
    hour and minute sets, never minute by minute."""
    local = at.astimezone(tz)
    hours = sorted(cron.hour, reverse=step < 0)
    minutes = sorted(cron.minute, reverse=step < 0)
    for days in range(_CRON_LOOKBACK_DAYS):
        day = local.date() + dt.timedelta(days=days * step)
        if not _cron_day_matches(cron, day):
            continue
        for hour in hours:
            for minute in minutes:
                wall = dt.datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz)
                if (step < 0 and wall <= local) or (step > 0 and wall > local):
                    return wall.astimezone(dt.UTC)
    return None


# --- the claim ---------------------------------------------------------------------------

CLAIM = CLAIM_IF_FREE  # the first to ask holds it
RELEASE = RELEASE_IF_MINE


@dataclass(frozen=True)
class Claim:
    """The answer of ``claim``: who holds the slot."""

    entry: str
    slot: str
    #: ``<task id>|<host>`` of this claimant.
    claimant: str
    #: The holder's ``<task id>|<host>``: ``claimant`` when this call claimed it.
    holder: str

    @property
    def won(self) -> bool:
        return self.holder == self.claimant

    @property
    def holder_task_id(self) -> str:
        return self.holder.split("|", 1)[0]

    @property
    def holder_host(self) -> str:
        return self.holder.split("|", 1)[-1]


def claim_key(entry: str, slot: str, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}periodic:{tagged(entry)}:{slot}"


#: The longest a claim is kept (a yearly crontab's slot need not hold for two years).
MAX_CLAIM_TTL = 31 * 86400.0


def claim_ttl(period: float) -> float:
    """How long a slot's claim is kept: twice the schedule's period, within bounds."""
    return min(max(2.0 * period, MIN_CLAIM_TTL), MAX_CLAIM_TTL)


def claim(
    entry: str,
    slot: str,
    task_id: str,
    host: str,
    *,
    ttl: float,
    redis_client: Any | None = None,
) -> Claim:
    """Claim ``(entry, slot)`` for the job ``task_id`` about to be published from
    ``host``, before it is published. A ``redis.RedisError`` escapes: the caller
    decides (``beat.SlotClaims`` publishes anyway; the key still holds)."""
    conn = redis_client or redis_state.client()
    claimant = f"{task_id}|{host}"
    holder = call(conn, CLAIM, [claim_key(entry, slot)], [claimant, max(1, int(ttl * 1000))])
    return Claim(entry=entry, slot=slot, claimant=claimant, holder=text(holder))


def release(found: Claim, *, redis_client: Any | None = None) -> bool:
    """Give back a claim whose message was never published (compare-and-delete), so
    the other beat, or this one's next tick, may publish the slot."""
    conn = redis_client or redis_state.client()
    return bool(call(conn, RELEASE, [claim_key(found.entry, found.slot)], [found.claimant]))


def count(task_name: str, outcome: str) -> None:
    """``explicit_periodic_slots_total{task,outcome}``; outcome published or duplicate."""
    metrics.periodic_slots.labels(task_name, outcome).inc()
