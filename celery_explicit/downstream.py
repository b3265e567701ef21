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
import time
from dataclasses import dataclass
from typing import Any

from celery_explicit import redis_state
from celery_explicit.redis_state import PREFIX, text


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


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
# ARGV[1] - now in milliseconds
# ARGV[2] - cool-down in milliseconds
# ARGV[3] - concurrency limit
# ARGV[4] - task id asking to enter
# ARGV[5] - slot lease in milliseconds
# return {verdict, state}: verdict 'admitted' or 'open' / 'probing' / 'busy' (deferred)
ENTER = """
local now = tonumber(ARGV[1])
local state = redis.call('hget', KEYS[1], 'state') or 'closed'
if state == 'open' then
    local opened = tonumber(redis.call('hget', KEYS[1], 'opened_ms') or '0')
    if now < opened + tonumber(ARGV[2]) then
        return {'open', state}
    end
    state = 'half_open'
    redis.call('hset', KEYS[1], 'state', state, 'probe', ARGV[4])
elseif state == 'half_open' and redis.call('hget', KEYS[1], 'probe') ~= ARGV[4] then
    return {'probing', state}
end
redis.call('zremrangebyscore', KEYS[2], '-inf', now)
if redis.call('zscore', KEYS[2], ARGV[4]) == false
        and redis.call('zcard', KEYS[2]) >= tonumber(ARGV[3]) then
    return {'busy', state}
end
redis.call('zadd', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
return {'admitted', state}
"""

# KEYS[1] - the breaker hash
# KEYS[2] - the slots sorted set
# ARGV[1] - now in milliseconds
# ARGV[2] - task id leaving
# ARGV[3] - 1 if the downstream failed transiently, 0 if it answered
# ARGV[4] - failure threshold
# return the breaker state after this execution
LEAVE = """
redis.call('zrem', KEYS[2], ARGV[2])
local state = redis.call('hget', KEYS[1], 'state') or 'closed'
if ARGV[3] == '1' then
    local failures = redis.call('hincrby', KEYS[1], 'failures', 1)
    if state == 'half_open' or failures >= tonumber(ARGV[4]) then
        redis.call('hset', KEYS[1], 'state', 'open', 'opened_ms', ARGV[1])
        redis.call('hdel', KEYS[1], 'probe')
        return 'open'
    end
    return state
end
redis.call('hset', KEYS[1], 'state', 'closed', 'failures', 0)
redis.call('hdel', KEYS[1], 'probe')
return 'closed'
"""


def _keys(name: str, prefix: str) -> list[str]:
    return [f"{prefix}breaker:{name}", f"{prefix}slots:{name}"]


def enter(
    downstream: Downstream,
    task_id: str,
    *,
    slot_lease: float,
    prefix: str = PREFIX,
    redis_client: Any | None = None,
) -> tuple[str, str]:
    """(verdict, breaker state): verdict ``admitted``, or why the execution is deferred."""
    conn = redis_client or redis_state.client()
    verdict, state = conn.eval(
        ENTER,
        2,
        *_keys(downstream.name, prefix),
        int(time.time() * 1000),
        int(downstream.cool_down * 1000),
        downstream.concurrency,
        task_id,
        max(1, int(slot_lease * 1000)),
    )
    return text(verdict), text(state)


def leave(
    downstream: Downstream,
    task_id: str,
    *,
    failed: bool,
    prefix: str = PREFIX,
    redis_client: Any | None = None,
) -> str:
    """Free the slot and feed the breaker; return its state after this execution."""
    conn = redis_client or redis_state.client()
    return text(
        conn.eval(
            LEAVE,
            2,
            *_keys(downstream.name, prefix),
            int(time.time() * 1000),
            task_id,
            1 if failed else 0,
            downstream.failure_threshold,
        )
    )


def state(
    downstream: Downstream, *, prefix: str = PREFIX, redis_client: Any | None = None
) -> dict[str, str]:
    """The breaker as an operator reads it (state, failures, opened_ms, probe)."""
    conn = redis_client or redis_state.client()
    raw = conn.hgetall(_keys(downstream.name, prefix)[0])
    info = {text(k): text(v) for k, v in raw.items()}
    # Failures are counted before the breaker ever changes state: no 'state' field yet.
    info.setdefault("state", BreakerState.CLOSED.value)
    return info


def slots_in_use(
    downstream: Downstream, *, prefix: str = PREFIX, redis_client: Any | None = None
) -> int:
    """Executions holding a slot of the concurrency limit right now."""
    conn = redis_client or redis_state.client()
    return int(conn.zcount(_keys(downstream.name, prefix)[1], time.time() * 1000, "+inf"))
