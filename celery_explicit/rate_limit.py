"""Keyed rate limits: at most ``limit`` starts per ``per`` seconds for each rendered key,
shared by every worker, fair across keys.

Celery's ``rate_limit`` is per worker (four workers let four times as many through)
and holds prefetched messages while it waits. A task declares instead::

    class CaptureCharge(ExplicitTask):
        rate_limit = RateLimit("stripe:{account_id}", 100, per=1.0)

The key is a template over ``run()``'s parameters (or a callable), like every key
here; jobs whose keys render alike share one budget, whichever task they belong to.

How a job is admitted (one script call per job): each key keeps its starts of the
last period and those reserved ahead, at most ``limit`` (``{prefix}rate:{<key>}``, a
list of epoch ms on the Redis server's clock, about 20 bytes a start, gone one period
after the last). A job asks once: it starts now if the key had fewer than ``limit``
starts in the last period (a burst of ``limit`` goes at once), else it is given the
first start one period after the ``limit``-th start before it and one interval
(``per / limit``) after the last, reserved then and there, and deferred until it:
re-published for that time, the pool slot freed at once, no attempt used. So no window
of ``per`` seconds holds more than ``limit`` reserved starts of a key, and a backlog's
starts are spread evenly. The deferred message carries its reservation
(``explicit_rate_slot``), so when it comes back it starts without asking again, and a
later step's deferral (a busy downstream) carries it on too.

That is what makes it fair: a key with 10,000 waiting jobs has reserved starts spread
over the next 100 seconds, and a key with one job finds its own budget untouched and
starts at once. The quiet key's job waits only for the worker to pass over the noisy
key's messages ahead of it in the queue, once each, a deferral apiece (bench/rate_limit.py
measures it); none of them comes back before its reserved start.

What bounds the count: the reservations, on the server's clock. A returning job starts
when the receiving worker's clock reaches its reservation (less ``EARLY``, for the
broker's timer), so workers' clocks apart by a few milliseconds shift a start by as
much, never add one. A job that comes back to a busy worker starts late; up to
``RateLimit.late`` late (an interval, at least a tenth of the period) it starts on its
reservation, so a period holds at most the starts reserved in it and one or two late
ones (an interval's worth); later than that it asks again once, for a start at the end
of the key's reservations (a second return that late starts anyway: a worker that is
always late must not defer a job for ever). A reservation whose job never comes back
(its worker died and the message went elsewhere) is a start not used: the limit errs
low, never high. A retry is a new start and asks again.

Failure policy: without Redis the job runs unlimited, with a WARNING and the metric's
``unguarded`` count, as the downstream limit does: a limit is protection for a
dependency, not a reason to stop the work. The dashboard lists the keys with reserved
starts ahead (``{prefix}rate-limited``, written only when a job is deferred).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_explicit import declarations, job_log, keys, metrics, redis_state
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, call, tagged
from celery_explicit.redis_state import text
from celery_explicit.steps import RUN, Decision, Defer, Job, Step

if TYPE_CHECKING:
    from celery_explicit.contract import Contract

__all__ = ["RateLimit", "RateLimitStep", "admit", "limited_keys"]

logger = job_log.get_logger("celery_explicit.rate_limit")

#: Message header holding a deferred job's reserved start:
#: ``<retries>:<epoch ms>:<asked again>``. The retry count binds it to the attempt it was
#: reserved for (Celery copies a message's headers onto its retry, which must ask
#: again); ``1`` when the job already asked again after coming back late.
SLOT_HEADER = "explicit_rate_slot"
#: A job that comes back this much before its reserved start (the receiving worker's
#: clock) starts anyway: the broker's ETA timer is not exact to the millisecond.
EARLY = 0.02


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` jobs per rendered ``key`` start in any ``per`` seconds."""

    key: keys.KeyDeclaration
    limit: int
    per: float = 1.0

    def __post_init__(self) -> None:
        def bad(message: str) -> ValueError:
            return ValueError(f"RateLimit {self.key!r}: {message}")

        if not (isinstance(self.key, str) and self.key.strip()) and not callable(self.key):
            raise bad("key must be a template like 'stripe:{account_id}' or a callable")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise bad(
                f"limit={self.limit!r} must be an integer >= 1 (a limit of 0 would never "
                "admit a job: to stop a task, cancel its jobs or stop its queue)"
            )
        if (
            isinstance(self.per, bool)
            or not isinstance(self.per, int | float)
            or not math.isfinite(self.per)
            or self.per <= 0
        ):
            raise bad(f"per={self.per!r} must be a positive number of seconds")

    @property
    def late(self) -> float:
        """Seconds a returning job may be late and still start on its reservation: an
        interval (``per / limit``), at least a tenth of the period."""
        return max(self.per / self.limit, self.per / 10.0)

    def describe(self) -> str:
        return f"{self.limit} per {self.per:g}s"


def declared(
    cls: type, params: tuple[str, ...], takes_kwargs: bool, refuse: declarations.Refuse
) -> RateLimit | None:
    """``rate_limit``: a ``RateLimit`` whose key's fields are ``run()`` parameters, or
    nothing. Celery's own string form is refused: it is per worker."""
    value = getattr(cls, "rate_limit", None)
    if value is None:
        return None
    if isinstance(value, str):
        raise refuse(
            f"rate_limit={value!r} is Celery's per-worker limit: N workers let N times as "
            "many through, and it holds prefetched messages while it waits; declare "
            "rate_limit = RateLimit('<name>:{<field>}', <limit>, per=<seconds>), shared by "
            "every worker and kept per key",
            "rate_limit",
        )
    if not isinstance(value, RateLimit):
        raise refuse(
            f"rate_limit={value!r} must be a celery_explicit.RateLimit(key, limit, per=...)",
            "rate_limit",
        )
    declarations.check_key_fields(value.key, params, takes_kwargs, refuse, "rate_limit")
    return value


# KEYS[1] - the key's starts, the newest first (epoch ms, the server's clock): at most
#           ``limit`` of them, each a start made or reserved, none older than a period
# ARGV[1] - the limit
# ARGV[2] - the period in milliseconds
# return {wait ms, start ms}: wait '0' when admitted now; else the reserved start
# A start goes at least one period after the ``limit``-th start before it, so no window
# of one period holds more than ``limit`` starts, and the list stays sorted: a
# reservation ahead exists only while the list is full, and each is later than the last
# (and at least one interval, period / limit, after it).
ADMIT = Script(
    "rate_limit_admit",
    SERVER_NOW_MS
    + """
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
-- Starts older than one period bound nothing: dropped, so a key keeps only the starts
-- of its last period and those reserved ahead (each start is popped once: O(1) a call).
local oldest = redis.call('lindex', KEYS[1], -1)
while oldest and tonumber(oldest) <= now_ms - period do
    redis.call('rpop', KEYS[1])
    oldest = redis.call('lindex', KEYS[1], -1)
end
local start = now_ms
if redis.call('llen', KEYS[1]) >= limit then
    local earlier = tonumber(redis.call('lindex', KEYS[1], limit - 1))
    if earlier + period > start then start = earlier + period end
    -- A backlog's starts go one interval (period / limit) apart, not in bursts of
    -- ``limit`` a period: a start that comes back late then crowds one interval,
    -- not a whole burst.
    local spaced = tonumber(redis.call('lindex', KEYS[1], 0)) + period / limit
    if spaced > start then start = spaced end
end
redis.call('lpush', KEYS[1], string.format('%.0f', start))
redis.call('ltrim', KEYS[1], 0, limit - 1)
redis.call('pexpire', KEYS[1], math.max(1, math.ceil(start - now_ms + period)))
return {string.format('%.0f', start - now_ms), string.format('%.0f', start)}
""",
)


def state_key(key: str, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}rate:{tagged(key)}"


def limited_set(*, prefix: str | None = None) -> str:
    """The sorted set of keys with reserved starts ahead (score: the last, epoch ms)."""
    return f"{prefix or redis_state.prefix()}rate-limited"


def admit(
    limit: RateLimit, key: str, *, prefix: str | None = None, redis_client: Any | None = None
) -> tuple[float, int]:
    """(seconds to wait, reserved start in epoch ms on the server's clock) for one job
    of ``key``: 0 seconds when it may start now."""
    conn = redis_client or redis_state.client()
    wait_ms, start_ms = call(
        conn, ADMIT, [state_key(key, prefix=prefix)], [limit.limit, f"{limit.per * 1000.0:.3f}"]
    )
    return int(text(wait_ms)) / 1000.0, int(text(start_ms))


def limited_keys(
    redis_client: Any | None = None, *, prefix: str | None = None
) -> list[tuple[str, float]]:
    """Keys with starts reserved ahead, and the seconds until their last one (for the
    dashboard); keys whose reservations have all passed are pruned here."""
    conn = redis_client or redis_state.client()
    now_ms = time.time() * 1000.0
    name = limited_set(prefix=prefix)
    conn.zremrangebyscore(name, "-inf", now_ms)
    return [
        (text(member), (float(score) - now_ms) / 1000.0)
        for member, score in conn.zrangebyscore(name, now_ms, "+inf", withscores=True)
    ]


def reservation(request: Any) -> tuple[int, bool] | None:
    """The reserved start (epoch ms) this message carries for its own attempt, and
    whether the job already asked again after coming back late; None if none."""
    raw = getattr(request, SLOT_HEADER, None)
    if not isinstance(raw, str):
        return None
    parts = raw.split(":")
    if len(parts) != 3:
        return None
    try:
        if int(parts[0]) != int(request.retries or 0):
            return None  # reserved for an earlier attempt: a retry asks again
        return int(parts[1]), parts[2] == "1"
    except ValueError:
        return None


class RateLimitStep(Step):
    """After the execution lease, before the downstream: a start within the key's
    limit, or a deferral to the start reserved for it."""

    name = "rate_limit"

    def __init__(self, task_name: str, limit: RateLimit) -> None:
        super().__init__(task_name)
        self.limit = limit

    @classmethod
    def declared(cls, contract: Contract) -> RateLimitStep | None:
        if contract.rate_limit is None:
            return None
        return cls(contract.task_name, contract.rate_limit)

    def before_run(self, job: Job) -> Decision:
        import redis

        execution, request = job.execution, job.request
        key = execution.rate_key
        reserved = reservation(request)
        start_ms: int | None = None
        asked_again = False
        wait = 0.0
        if reserved is not None:
            start_ms, asked_again = reserved
            wait = start_ms / 1000.0 - time.time()
            if wait < -self.limit.late and not asked_again:
                # Back late (its worker was busy): starting now on the old reservation
                # could crowd the starts reserved for this period. It asks again, once.
                start_ms, asked_again = None, True
        if start_ms is None:
            try:
                wait, start_ms = admit(self.limit, key)
            except redis.RedisError:
                metrics.rate_limit.labels(self.task_name, "unguarded").inc()
                logger.warning(
                    "rate limit %s: state store unavailable, running unlimited",
                    key,
                    extra=execution.log_fields(),
                )
                return RUN
        # Whatever defers the job from here on (this step, a busy downstream), it comes
        # back with its start: the one reservation it made.
        execution.deferral_headers[SLOT_HEADER] = (
            f"{int(request.retries or 0)}:{start_ms}:{int(asked_again)}"
        )
        if wait <= EARLY:
            return RUN
        metrics.rate_limit.labels(self.task_name, "deferred").inc()
        note_limited(key, start_ms)
        return Defer(
            wait,
            f"rate limit {key} ({self.limit.describe()}) has no room: runs at its reserved start",
            {"rate_limit_key": key},
        )


def note_limited(key: str, start_ms: int) -> None:
    """Tell the dashboard ``key`` has starts reserved until at least ``start_ms``."""
    import redis

    # The dashboard's list only: the deferral itself is logged and counted.
    with contextlib.suppress(redis.RedisError):
        redis_state.client().zadd(limited_set(), {key: start_ms}, gt=True)
