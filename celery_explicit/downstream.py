"""Per-downstream limits: a concurrency limit shared by all workers, and a circuit breaker.

A retry storm is many workers hammering a sick dependency at once. A task declares the
downstream it calls (``downstream = WAREHOUSE``); every task naming the same downstream
shares its limits:

- at most ``concurrency`` executions call it at a time, across all workers (a Redis
  sorted set of holders, each entry expiring so a dead worker cannot keep a slot);
- after ``failure_threshold`` transient failures in a row the breaker opens: new
  executions are not run but deferred (published again with a jittered delay, the pool
  slot freed at once, the attempt count untouched); after ``cool_down`` seconds one
  execution probes; its success closes the breaker, its failure opens it again.

State lives in Redis (``EXPLICIT_REDIS_URL``): ``{prefix}breaker:{name}`` (state,
failures, opened_ms, probe) and ``{prefix}slots:{name}``.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_explicit import job_log, metrics, redis_state
from celery_explicit.execution import Execution
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, call, server_time, tagged
from celery_explicit.redis_state import text
from celery_explicit.steps import RUN, Decision, Defer, Ending, Job, Step

if TYPE_CHECKING:
    from celery_explicit.contract import Contract

logger = job_log.get_logger("celery_explicit.downstream")
_rng = random.SystemRandom()


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Admission(enum.StrEnum):
    """What the downstream says to an execution that asks to enter."""

    ADMITTED = "admitted"
    #: Deferred: the breaker is open and its cool-down not over.
    OPEN = "open"
    #: Deferred: the breaker is half open and another execution is its probe.
    PROBING = "probing"
    #: Deferred: every slot of the concurrency limit is taken.
    BUSY = "busy"


@dataclass(frozen=True)
class Downstream:
    """A dependency shared by tasks: its concurrency limit and breaker settings."""

    name: str
    concurrency: int
    failure_threshold: int = 5
    cool_down: float = 30.0
    #: Base of the jittered delay before a deferred execution is tried again.
    defer_base: float = 1.0

    def __post_init__(self) -> None:
        def bad(message: str) -> ValueError:
            return ValueError(f"Downstream {self.name!r}: {message}")

        if not self.name or ":" in self.name:
            raise bad("name must be non-empty and without ':'")
        for field in ("concurrency", "failure_threshold"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"{field}={value!r} must be an integer >= 1")
        for field in ("cool_down", "defer_base"):
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise bad(f"{field}={value!r} must be a positive number of seconds")


# KEYS[1] - the breaker hash
# KEYS[2] - the slots sorted set (member: task id, score: slot expiry in ms)
# ARGV[1] - cool-down in milliseconds
# ARGV[2] - concurrency limit
# ARGV[3] - task id asking to enter
# ARGV[4] - slot lease in milliseconds
# return {admission, state}: admission 'admitted' or 'open' / 'probing' / 'busy' (deferred)
# Every time here is the server's (``opened_ms``, the slots' expiries): the worker that
# opened the breaker or took a slot and the one comparing may disagree on the time.
ENTER = Script(
    "downstream_enter",
    SERVER_NOW_MS
    + """
local now = now_ms
local state = redis.call('hget', KEYS[1], 'state') or 'closed'
if state == 'open' then
    local opened = tonumber(redis.call('hget', KEYS[1], 'opened_ms') or '0')
    if now < opened + tonumber(ARGV[1]) then
        return {'open', state}
    end
    state = 'half_open'
    redis.call('hset', KEYS[1], 'state', state, 'probe', ARGV[3])
elseif state == 'half_open' and redis.call('hget', KEYS[1], 'probe') ~= ARGV[3] then
    return {'probing', state}
end
redis.call('zremrangebyscore', KEYS[2], '-inf', now)
if redis.call('zscore', KEYS[2], ARGV[3]) == false
        and redis.call('zcard', KEYS[2]) >= tonumber(ARGV[2]) then
    return {'busy', state}
end
redis.call('zadd', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
return {'admitted', state}
""",
)

# KEYS[1] - the breaker hash
# KEYS[2] - the slots sorted set
# ARGV[1] - task id leaving
# ARGV[2] - 1 if the downstream failed transiently, 0 if it answered
# ARGV[3] - failure threshold
# return the breaker state after this execution
LEAVE = Script(
    "downstream_leave",
    SERVER_NOW_MS
    + """
redis.call('zrem', KEYS[2], ARGV[1])
local state = redis.call('hget', KEYS[1], 'state') or 'closed'
if ARGV[2] == '1' then
    local failures = redis.call('hincrby', KEYS[1], 'failures', 1)
    if state == 'half_open' or failures >= tonumber(ARGV[3]) then
        redis.call('hset', KEYS[1], 'state', 'open', 'opened_ms', now_ms)
        redis.call('hdel', KEYS[1], 'probe')
        return 'open'
    end
    return state
end
redis.call('hset', KEYS[1], 'state', 'closed', 'failures', 0)
redis.call('hdel', KEYS[1], 'probe')
return 'closed'
""",
)


def keys(name: str, *, prefix: str | None = None) -> list[str]:
    """The breaker hash and the slots set of downstream ``name`` (one hash tag)."""
    head = prefix or redis_state.prefix()
    return [f"{head}breaker:{tagged(name)}", f"{head}slots:{tagged(name)}"]


def enter(
    downstream: Downstream,
    task_id: str,
    *,
    slot_ttl: float,
    prefix: str | None = None,
    redis_client: Any | None = None,
) -> tuple[Admission, BreakerState]:
    """(admission, breaker state): ``ADMITTED``, or why the execution is deferred. A slot
    expires after ``slot_ttl`` seconds, so a dead worker cannot keep it."""
    conn = redis_client or redis_state.client()
    args = [
        int(downstream.cool_down * 1000),
        downstream.concurrency,
        task_id,
        max(1, int(slot_ttl * 1000)),
    ]
    admission, state = call(conn, ENTER, keys(downstream.name, prefix=prefix), args)
    return Admission(text(admission)), BreakerState(text(state))


def leave(
    downstream: Downstream,
    task_id: str,
    *,
    failed: bool,
    prefix: str | None = None,
    redis_client: Any | None = None,
) -> BreakerState:
    """Free the slot and feed the breaker; return its state after this execution."""
    conn = redis_client or redis_state.client()
    args = [task_id, 1 if failed else 0, downstream.failure_threshold]
    return BreakerState(text(call(conn, LEAVE, keys(downstream.name, prefix=prefix), args)))


def state(
    downstream: Downstream, *, prefix: str | None = None, redis_client: Any | None = None
) -> dict[str, str]:
    """The breaker as an operator reads it (state, failures, opened_ms, probe)."""
    conn = redis_client or redis_state.client()
    raw = conn.hgetall(keys(downstream.name, prefix=prefix)[0])
    info = {text(k): text(v) for k, v in raw.items()}
    # Failures are counted before the breaker ever changes state: no 'state' field yet.
    info.setdefault("state", BreakerState.CLOSED.value)
    return info


def slots_in_use(
    downstream: Downstream, *, prefix: str | None = None, redis_client: Any | None = None
) -> int:
    """Executions holding a slot of the concurrency limit right now."""
    conn = redis_client or redis_state.client()
    now_ms = server_time(conn) * 1000  # the slots' expiries are the server's
    return int(conn.zcount(keys(downstream.name, prefix=prefix)[1], now_ms, "+inf"))


class DownstreamStep(Step):
    """Last before the handler: a slot of the downstream's limit, or defer.

    Its failure policy: without Redis the job runs unguarded, loudly. Only a transient
    error counts against the downstream: a declined card is an answer, and our own
    bug is not the warehouse's fault.
    """

    name = "downstream"

    def __init__(self, task_name: str, downstream: Downstream, slot_ttl: float) -> None:
        super().__init__(task_name)
        self.downstream, self.slot_ttl = downstream, slot_ttl

    @classmethod
    def declared(cls, contract: Contract) -> DownstreamStep | None:
        if contract.downstream is None:
            return None
        # A slot is held no longer than the execution lease it runs under.
        return cls(contract.task_name, contract.downstream, contract.visibility_timeout)

    def before_run(self, job: Job) -> Decision:
        import redis

        name = self.downstream.name
        try:
            admission, breaker = enter(
                self.downstream, job.execution.task_id, slot_ttl=self.slot_ttl
            )
        except redis.RedisError:
            logger.warning(
                "downstream %s: limits unavailable, running unguarded",
                name,
                extra={"task": self.task_name},
            )
            return RUN
        if admission is Admission.ADMITTED:
            return RUN
        metrics.downstream_deferred.labels(name, admission).inc()
        return Defer(
            _rng.uniform(0.5, 1.5) * self.downstream.defer_base,
            f"downstream {name} {admission} ({breaker})",
            {"downstream": name, "admission": admission},
        )

    def after_run(
        self, request: Any, execution: Execution | None, ending: Ending, *, entered: bool
    ) -> None:
        import redis

        if execution is None or not entered:
            return  # never admitted: no slot to free, no answer to count
        name = self.downstream.name
        try:
            breaker = leave(self.downstream, execution.task_id, failed=ending.transient_failure)
        except redis.RedisError:
            logger.warning(
                "downstream %s: could not free the slot (it expires with the lease)",
                name,
                extra={"task": self.task_name},
            )
            return
        metrics.breaker_open.labels(name).set(1 if breaker is BreakerState.OPEN else 0)
