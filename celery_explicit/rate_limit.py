"""Keyed rate limits: at most ``limit`` starts per ``per`` seconds for each rendered key,
shared by every worker, fair across keys.

Celery's ``rate_limit`` is per worker (four workers let four times as many through)
and holds prefetched messages while it waits. A task declares instead::

    class CaptureCharge(ExplicitTask):
        rate_limit = RateLimit("stripe:{account_id}", 100, per=1.0)

The key is a template over ``run()``'s parameters (or a callable), like every key
here; jobs whose keys render alike share one budget, whichever task they belong to.

How a job is admitted (one script call per job, one more for a job it deferred): each
key keeps two short lists in Redis, on the server's clock (``{prefix}rate:{<key>}`` and
``{prefix}rate-started:{<key>}``, epoch ms, at most ``limit`` entries each, about 20
bytes an entry, none older than a period, gone a period after the last):

- its reservations: a job asks once; it is given now if the key had fewer than
  ``limit`` reservations in the last period (a burst of ``limit`` goes at once), else
  the first moment one period after the ``limit``-th reservation before it and one
  interval (``per / limit``) after the last, and is deferred to it: re-published for
  that time, the pool slot freed at once, no attempt used. The message carries its
  reservation (``explicit_rate_slot``); a later step's deferral (a busy downstream)
  carries it on too, so the job keeps its place;
- its starts: a job whose reservation is due starts only if fewer than ``limit`` jobs
  of the key started in the last period, and is recorded; else it waits for the
  moment there is room, keeping its reservation. So no period holds more than
  ``limit`` starts of a key (on the server's clock, less ``EARLY``), whether the jobs
  came back on time or late to a busy worker.

That is what makes it fair: a key with 10,000 waiting jobs has its reservations spread
over the next 100 seconds, and a key with one job finds its own lists untouched and
starts at once. The quiet key's job waits only for the worker to pass over the noisy
key's messages ahead of it in the queue, once each, a deferral apiece (bench/rate_limit.py
measures it). A reservation whose job never comes back (its worker died and the message
went elsewhere) is a start not used: the limit errs low, never high. A retry is a new
job for the limit and asks again.

Failure policy: without Redis the job runs unlimited, with a WARNING and the metric's
``unguarded`` count, as the downstream limit does: a limit is protection for a
dependency, not a reason to stop the work. The dashboard lists the keys with reserved
starts ahead (``{prefix}rate-limited``, written only when a job is deferred).
"""

from __future__ import annotations

import contextlib
import math
import random
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
_rng = random.SystemRandom()

#: Message header holding a deferred job's reservation: ``<retries>:<epoch ms>``. The
#: retry count binds it to the attempt it was reserved for (Celery copies a message's
#: headers onto its retry, which must ask again).
SLOT_HEADER = "explicit_rate_slot"
#: A job that comes back this much before its reservation (the Redis server's clock)
#: may start: the broker's ETA timer and the workers' clocks are not exact.
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


# KEYS[1] - the key's reservations, the newest first (epoch ms, the server's clock): at
#           most ``limit``, none older than a period
# KEYS[2] - the key's starts made, the newest first: at most ``limit``, none older than a
#           period
# ARGV[1] - the limit   ARGV[2] - the period in milliseconds
# ARGV[3] - the job's reservation (epoch ms), or '' for a job that has none yet
# ARGV[4] - milliseconds early a reservation may start (the broker's timer)
# return {wait ms, reservation ms, why}: wait '0' and 'started' when the job starts now
#   (recorded as made); else 'reserved' (its reservation is ahead) or 'room' (due, but
#   the last period had its ``limit`` starts)
# A reservation goes at least one period after the ``limit``-th before it and one
# interval (period / limit) after the last, so a backlog is spread evenly and no
# period holds more than ``limit`` reservations; both lists stay sorted. A job whose
# reservation is due starts only if fewer than ``limit`` starts were made in the last
# period: a job that comes back late to a busy worker waits for room rather than
# crowd the period it lands in, and keeps its place.
ADMIT = Script(
    "rate_limit_admit",
    SERVER_NOW_MS
    + """
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
-- What is older than one period bounds nothing: dropped (each entry once: O(1) a call).
for _, name in ipairs(KEYS) do
    local oldest = redis.call('lindex', name, -1)
    while oldest and tonumber(oldest) <= now_ms - period do
        redis.call('rpop', name)
        oldest = redis.call('lindex', name, -1)
    end
end
local reserved = tonumber(ARGV[3])
if not reserved then
    reserved = now_ms
    if redis.call('llen', KEYS[1]) >= limit then
        local earlier = tonumber(redis.call('lindex', KEYS[1], limit - 1))
        if earlier + period > reserved then reserved = earlier + period end
        local spaced = tonumber(redis.call('lindex', KEYS[1], 0)) + period / limit
        if spaced > reserved then reserved = spaced end
    end
    redis.call('lpush', KEYS[1], string.format('%.0f', reserved))
    redis.call('ltrim', KEYS[1], 0, limit - 1)
    redis.call('pexpire', KEYS[1], math.max(1, math.ceil(reserved - now_ms + period)))
end
local shown = string.format('%.0f', reserved)
if reserved > now_ms + tonumber(ARGV[4]) then
    return {string.format('%.0f', reserved - now_ms), shown, 'reserved'}
end
if redis.call('llen', KEYS[2]) >= limit then
    local room = tonumber(redis.call('lindex', KEYS[2], limit - 1)) + period
    return {string.format('%.0f', math.max(1, room - now_ms)), shown, 'room'}
end
redis.call('lpush', KEYS[2], string.format('%.0f', now_ms))
redis.call('ltrim', KEYS[2], 0, limit - 1)
redis.call('pexpire', KEYS[2], math.max(1, math.ceil(period)))
return {'0', shown, 'started'}
""",
)


def state_keys(key: str, *, prefix: str | None = None) -> list[str]:
    """The key's reservations and its starts made (one hash tag: one Cluster slot)."""
    head = prefix or redis_state.prefix()
    return [f"{head}rate:{tagged(key)}", f"{head}rate-started:{tagged(key)}"]


def limited_set(*, prefix: str | None = None) -> str:
    """The sorted set of keys with reserved starts ahead (score: the last, epoch ms)."""
    return f"{prefix or redis_state.prefix()}rate-limited"


def admit(
    limit: RateLimit,
    key: str,
    reserved_ms: int | None = None,
    *,
    prefix: str | None = None,
    redis_client: Any | None = None,
) -> tuple[float, int, str]:
    """(seconds to wait, reservation in epoch ms on the server's clock, why) for one job
    of ``key``: 0 seconds and ``started`` when it starts now. A job with no reservation
    yet is given one; a job whose reservation is due starts if the last period has room
    (``room``: it has not)."""
    conn = redis_client or redis_state.client()
    wait_ms, start_ms, why = call(
        conn,
        ADMIT,
        state_keys(key, prefix=prefix),
        [
            limit.limit,
            f"{limit.per * 1000.0:.3f}",
            "" if reserved_ms is None else reserved_ms,
            int(EARLY * 1000),
        ],
    )
    return int(text(wait_ms)) / 1000.0, int(text(start_ms)), text(why)


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


def reservation(request: Any) -> int | None:
    """The reservation (epoch ms) this message carries for its own attempt, if any."""
    raw = getattr(request, SLOT_HEADER, None)
    if not isinstance(raw, str) or ":" not in raw:
        return None
    retries, _, start = raw.partition(":")
    try:
        if int(retries) != int(request.retries or 0):
            return None  # reserved for an earlier attempt: a retry asks again
        return int(start)
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
        try:
            wait, start_ms, why = admit(self.limit, key, reservation(request))
        except redis.RedisError:
            metrics.rate_limit.labels(self.task_name, "unguarded").inc()
            logger.warning(
                "rate limit %s: state store unavailable, running unlimited",
                key,
                extra=execution.log_fields(),
            )
            return RUN
        # Whatever defers the job from here on (this step, a busy downstream), it comes
        # back with its reservation: its place among the key's jobs.
        execution.deferral_headers[SLOT_HEADER] = f"{int(request.retries or 0)}:{start_ms}"
        if wait <= 0:
            return RUN
        if why == "room":
            # Due, but the period is full: several jobs back late at once would all
            # come back at the one moment there is room for one; spread them.
            wait += _rng.uniform(0.0, self.limit.per / self.limit.limit)
        metrics.rate_limit.labels(self.task_name, "deferred").inc()
        note_limited(key, start_ms)
        return Defer(
            wait,
            f"rate limit {key} ({self.limit.describe()}) has no room: waits for its reserved start",
            {"rate_limit_key": key},
        )


def note_limited(key: str, start_ms: int) -> None:
    """Tell the dashboard ``key`` has starts reserved until at least ``start_ms``."""
    import redis

    # The dashboard's list only: the deferral itself is logged and counted.
    with contextlib.suppress(redis.RedisError):
        redis_state.client().zadd(limited_set(), {key: start_ms}, gt=True)
