"""Per-entity ordering: jobs for one entity run one at a time, in publish order.

Two workers that each take an event for order 7 ("paid", then "cancelled") can finish
them in either order, and the entity ends up in whichever state was written last.
A task that declares ``ordering_key = "order:{order_id}"`` gets, per rendered key:

- a sequence number taken when the job is published (``INCR``): publish order is the
  order, across every process that publishes;
- a turn: the job whose number is next runs; a later one that is delivered first is
  deferred (re-published a moment later, its pool slot free at once), never blocked
  in a pool process;
- the turn passes on when the job ends for good (success, dead letter, dropped), not
  when it schedules a retry: the entity's later jobs wait for its retries.

A job that will never come (its publish failed after it got its number, it was purged,
its message was lost) would hold its entity forever. A failed publish gives its number
back at once; otherwise, when the job ahead has shown no sign of life for
``ordering_gap`` seconds (default: twice the visibility timeout plus the backoff cap),
the waiting job goes ahead, logged and counted. The job ahead shows life by holding
its execution lease (``celery_explicit.execution_lease``) while it runs; between
retries its next attempt must come within the gap. A straggler that arrives after it was
skipped still runs: guard such writes with a version (``versioned_update``).

Never global ordering: only jobs that render the same key wait for each other.

State in Redis (``EXPLICIT_REDIS_URL``), per key, expiring a week after last use:
``{prefix}order:{key}:published`` (last number given), ``:next`` (whose turn),
``:skipped`` (numbers given back), ``:waiting`` (since when the turn has not moved).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery_explicit import redis_state
from celery_explicit.redis_state import PREFIX

#: Message headers: the rendered key and the job's number in it.
KEY_HEADER = "explicit_ordering_key"
SEQ_HEADER = "explicit_ordering_seq"
STATE_TTL = 7 * 24 * 3600

# KEYS[1] - published counter
# ARGV[1] - state ttl (s)
PUBLISH = """
local seq = redis.call('incr', KEYS[1])
redis.call('expire', KEYS[1], ARGV[1])
return seq
"""

# KEYS[1] - next   KEYS[2] - skipped set   KEYS[3] - waiting since (ms)
# KEYS[4] - the job holding the turn (its task id)
# ARGV[1] - this job's number   ARGV[2] - now (ms)   ARGV[3] - gap (ms)   ARGV[4] - ttl (s)
# ARGV[5] - this job's task id  ARGV[6] - execution lease key prefix
# return {verdict, whose turn it is}: 1 run (its turn, or already passed), 0 wait,
# 2 run after skipping the missing ones
TURN = """
local nxt = tonumber(redis.call('get', KEYS[1]) or '1')
while redis.call('srem', KEYS[2], nxt) == 1 do
    nxt = nxt + 1
end
redis.call('set', KEYS[1], nxt, 'EX', ARGV[4])
local seq = tonumber(ARGV[1])
if seq == nxt then
    redis.call('del', KEYS[3])
    redis.call('set', KEYS[4], ARGV[5], 'EX', ARGV[4])
    return {1, nxt}
end
if seq < nxt then
    return {1, nxt}
end
-- The job holding the turn is alive while its execution lease exists (the worker
-- extends it): the gap clock counts only time in which nobody holds the turn. (The
-- lease key is built here, not passed in KEYS: one Redis, not a cluster.)
local head = redis.call('get', KEYS[4])
if head and redis.call('exists', ARGV[6] .. head) == 1 then
    redis.call('del', KEYS[3])
end
local since = tonumber(redis.call('get', KEYS[3]) or '0')
if since == 0 then
    redis.call('set', KEYS[3], ARGV[2], 'EX', ARGV[4])
    return {0, nxt}
end
if tonumber(ARGV[2]) - since > tonumber(ARGV[3]) then
    redis.call('set', KEYS[1], seq, 'EX', ARGV[4])
    redis.call('del', KEYS[3])
    redis.call('set', KEYS[4], ARGV[5], 'EX', ARGV[4])
    return {2, nxt}
end
return {0, nxt}
"""

# KEYS[1] - next   KEYS[2] - waiting since   KEYS[3] - skipped set
# ARGV[1] - this job's number   ARGV[2] - ttl
# The turn passes on only from the job that holds it. A job that ended for good before
# its turn (bad input, the delivery limit, a dedup drop) gives its number back, so the
# jobs behind it do not wait for it.
DONE = """
local nxt = tonumber(redis.call('get', KEYS[1]) or '1')
local seq = tonumber(ARGV[1])
if seq == nxt then
    redis.call('set', KEYS[1], nxt + 1, 'EX', ARGV[2])
    redis.call('del', KEYS[2])
    return 1
end
if seq > nxt then
    redis.call('sadd', KEYS[3], seq)
    redis.call('expire', KEYS[3], ARGV[2])
end
return 0
"""


def _keys(key: str) -> dict[str, str]:
    base = f"{PREFIX}order:{key}"
    return {
        "published": f"{base}:published",
        "next": f"{base}:next",
        "skipped": f"{base}:skipped",
        "waiting": f"{base}:waiting",
        "head": f"{base}:head",
    }


def place_headers(place: tuple[str, int]) -> dict[str, Any]:
    """The message headers carrying a job's (ordering key, number)."""
    key, seq = place
    return {KEY_HEADER: key, SEQ_HEADER: seq}


def place_of(request: Any) -> tuple[str, int] | None:
    """(ordering key, number) from a running job's headers, if it was published with one."""
    return place_in(
        {
            KEY_HEADER: getattr(request, KEY_HEADER, None),
            SEQ_HEADER: getattr(request, SEQ_HEADER, None),
        }
    )


def place_in(headers: Mapping[str, Any]) -> tuple[str, int] | None:
    """(ordering key, number) from a message's headers (the worker's main process)."""
    key = headers.get(KEY_HEADER)
    seq = headers.get(SEQ_HEADER)
    if not key or seq is None:
        return None
    try:
        return str(key), int(seq)
    except (TypeError, ValueError):
        return None


_recording: ContextVar[list[tuple[str, int]] | None] = ContextVar(
    "explicit_ordering_numbers", default=None
)


@contextmanager
def record_numbers() -> Iterator[list[tuple[str, int]]]:
    """Collect the numbers taken inside the block: a publisher that buffers messages
    (the outbox relay's batch) gives them back if the buffer is thrown away."""
    taken: list[tuple[str, int]] = []
    token = _recording.set(taken)
    try:
        yield taken
    finally:
        _recording.reset(token)


def take_number(key: str, *, client: Any | None = None) -> int:
    """The job's place in its entity's order; taken just before it is published."""
    conn = client or redis_state.client()
    seq = int(redis_state.script(conn, PUBLISH)(keys=[_keys(key)["published"]], args=[STATE_TTL]))
    recording = _recording.get()
    if recording is not None:
        recording.append((key, seq))
    return seq


def give_back(key: str, seq: int, *, client: Any | None = None) -> None:
    """The publish of job ``seq`` failed: the jobs behind it must not wait for it."""
    conn = client or redis_state.client()
    skipped = _keys(key)["skipped"]
    conn.pipeline(transaction=False).sadd(skipped, seq).expire(skipped, STATE_TTL).execute()


@dataclass(frozen=True)
class Turn:
    run: bool
    #: The number whose turn it was when asked.
    next_seq: int
    #: True when missing jobs ahead were skipped after waiting ``gap`` seconds.
    skipped_ahead: bool = False


def turn(key: str, seq: int, task_id: str, *, gap: float, client: Any | None = None) -> Turn:
    """May job ``seq`` (task ``task_id``) of ``key`` run now?"""
    from celery_explicit.execution_lease import lease_key

    conn = client or redis_state.client()
    names = _keys(key)
    verdict, nxt = redis_state.script(conn, TURN)(
        keys=[names["next"], names["skipped"], names["waiting"], names["head"]],
        args=[seq, int(time.time() * 1000), int(gap * 1000), STATE_TTL, task_id, lease_key("")],
    )
    return Turn(run=int(verdict) != 0, next_seq=int(nxt), skipped_ahead=int(verdict) == 2)


def done(key: str, seq: int, *, client: Any | None = None) -> bool:
    """Job ``seq`` ended for good: the next one's turn. False if it was not its turn
    (a job ahead of its turn gives its number back instead)."""
    conn = client or redis_state.client()
    names = _keys(key)
    done_script = redis_state.script(conn, DONE)
    keys = [names["next"], names["waiting"], names["skipped"]]
    return bool(done_script(keys=keys, args=[seq, STATE_TTL]))


def position(key: str, *, client: Any | None = None) -> tuple[int, int]:
    """(last number published, whose turn it is) for an operator."""
    conn = client or redis_state.client()
    names = _keys(key)
    published, nxt = conn.mget(names["published"], names["next"])
    return int(published or 0), int(nxt or 1)
