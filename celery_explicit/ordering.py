"""Per-entity ordering: jobs for one entity run one at a time, in publish order.

Two workers that each take an event for order 7 ("paid", then "cancelled") can finish
them in either order, and the entity ends up in whichever state was written last. A
task that declares ``ordering_key = "order:{order_id}"`` gets, per rendered key: a
number taken when the job is published (publish order is the order, across every
publisher); a turn (the job whose number is next runs; a later one delivered first is
deferred, never blocking a pool process); and the turn passes on when the job ends for
good (success, dead letter, dropped), not when it schedules a retry.

A job that will never come (its publish failed after it got its number, it was purged,
its message was lost) would hold its entity forever. A failed publish gives its number
back at once; otherwise, when the job ahead has shown no sign of life for
``ordering_gap`` seconds (default: twice the visibility timeout plus the backoff cap),
the waiting job goes ahead, logged and counted. The job holding the turn shows life by
its ``alive`` key, set when it takes the turn for its visibility timeout and extended
by the worker's heartbeat while its handler runs (``celery_explicit.message_lease_keeper``);
between retries its next attempt must come within the gap. A straggler that arrives after it
was skipped still runs: guard such writes with a version (``versioned_update``).

State in Redis (``EXPLICIT_REDIS_URL``), per key, with the key as the hash tag (one
Redis Cluster slot): ``{prefix}order:{<key>}:published`` (last number given), ``:next``
(whose turn), ``:skipped`` (numbers given back), ``:waiting`` (since when the turn has
not moved), ``:alive`` (the turn holder's task id, for its lease).

How long it lives. While an entity has jobs to come, each key expires ``STATE_TTL`` (a
week) after its last use. When the last job given a number ends for good, the entity
is idle: ``:skipped`` and ``:waiting`` are deleted, and ``:published`` and ``:next``
expire ``IDLE_TTL`` (a day) later. Until then a late copy of a finished job (a
redelivery) finds its number behind the turn and runs at once, as before. After it, the
entity's state is gone, and that is the state of an entity never seen: the next job
published gets number 1 and runs. A copy of a job from before arriving after the
horizon counts as a job whose predecessors never came (it waits out the gap, then
runs): guard its write with a version (``versioned_update``), as for any straggler.

This module is the order itself: the declaration, its scripts and keys, taking a number,
asking for the turn and passing it on. The step that asks before the handler runs (and
defers a job whose turn has not come) is ``celery_explicit.ordering_step``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery_explicit import declarations, job_log, keys, redis_state
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, call, tagged

logger = job_log.get_logger("celery_explicit.ordering")


@dataclass(frozen=True)
class Ordering:
    key: keys.KeyDeclaration
    #: Seconds a job waits for a missing earlier one before going ahead without it.
    gap: float


def declared(
    cls: type,
    params: tuple[str, ...],
    takes_kwargs: bool,
    refuse: declarations.Refuse,
    visibility: float,
    backoff_cap: float,
) -> Ordering | None:
    found = declarations.key_with_duration(
        cls,
        params,
        takes_kwargs,
        refuse,
        key_attr="ordering_key",
        duration_attr="ordering_gap",
        example="'order:{order_id}'",
        without_key="declare the entity whose jobs run in order, "
        "e.g. ordering_key='order:{order_id}'",
    )
    if found is None:
        return None
    key, gap = found
    # By default long enough for the job ahead to lose its lease, be redelivered and
    # wait out a full backoff: only a job that will never come is skipped.
    return Ordering(key=key, gap=2 * visibility + backoff_cap if gap is None else gap)


#: Message headers: the rendered key and the job's number in it.
KEY_HEADER = "explicit_ordering_key"
SEQ_HEADER = "explicit_ordering_seq"
#: Seconds an entity's state lives after its last use while it has jobs to come.
STATE_TTL = 7 * 24 * 3600
#: Seconds an idle entity (every number given has had its turn) keeps its counters:
#: longer than any late copy of a finished job takes to arrive (a redelivery comes
#: within the broker's backstop ``visibility_timeout``, an hour by default).
IDLE_TTL = 24 * 3600

# KEYS[1] - published counter
# ARGV[1] - state ttl (s)
# return the job's number in its entity's order
PUBLISH = Script(
    "ordering_publish",
    """
local seq = redis.call('incr', KEYS[1])
redis.call('expire', KEYS[1], ARGV[1])
return seq
""",
)

# KEYS[1] - next   KEYS[2] - skipped set   KEYS[3] - waiting since (ms, server clock)
# KEYS[4] - alive: the task id of the job holding the turn, while it runs
# ARGV[1] - this job's number   ARGV[2] - gap (ms)   ARGV[3] - ttl (s)
# ARGV[4] - this job's task id  ARGV[5] - its lease (ms): how long "alive" lasts unless
#           the worker extends it
# return {verdict, whose turn it is}: 1 run (its turn, or already passed), 0 wait,
# 2 run after skipping the missing ones
# The waiting-since time is the server's: the worker that starts the gap clock and the
# one that finds it run out may be on hosts whose clocks disagree.
TURN = Script(
    "ordering_turn",
    SERVER_NOW_MS
    + """
local nxt = tonumber(redis.call('get', KEYS[1]) or '1')
while redis.call('srem', KEYS[2], nxt) == 1 do
    nxt = nxt + 1
end
redis.call('set', KEYS[1], nxt, 'EX', ARGV[3])
local seq = tonumber(ARGV[1])
if seq == nxt then
    redis.call('del', KEYS[3])
    redis.call('set', KEYS[4], ARGV[4], 'PX', ARGV[5])
    return {1, nxt}
end
if seq < nxt then
    return {1, nxt}
end
-- The job holding the turn is alive while its "alive" key exists (the worker extends
-- it while the handler runs): the gap clock counts only time in which nobody holds
-- the turn.
if redis.call('exists', KEYS[4]) == 1 then
    redis.call('del', KEYS[3])
end
local since = tonumber(redis.call('get', KEYS[3]) or '0')
if since == 0 then
    redis.call('set', KEYS[3], now_ms, 'EX', ARGV[3])
    return {0, nxt}
end
if now_ms - since > tonumber(ARGV[2]) then
    redis.call('set', KEYS[1], seq, 'EX', ARGV[3])
    redis.call('del', KEYS[3])
    redis.call('set', KEYS[4], ARGV[4], 'PX', ARGV[5])
    return {2, nxt}
end
return {0, nxt}
""",
)

# KEYS[1] - next   KEYS[2] - waiting since   KEYS[3] - skipped set   KEYS[4] - alive
# KEYS[5] - published counter
# ARGV[1] - this job's number   ARGV[2] - ttl   ARGV[3] - this job's task id
# ARGV[4] - idle ttl (s): how long an entity with no job left keeps its state
# return 1 if the turn passed on, 0 if it was not this job's turn
# The turn passes on only from the job that holds it. A job that ended for good before
# its turn (bad input, the delivery limit, a dedup drop) gives its number back, so the
# jobs behind it do not wait for it. When the turn passes beyond the last number given,
# the entity is idle: its skipped numbers are all behind the turn (dropped) and its two
# counters keep the idle ttl, to place a late copy of a job that already ran.
DONE = Script(
    "ordering_done",
    """
if redis.call('get', KEYS[4]) == ARGV[3] then
    redis.call('del', KEYS[4])
end
local nxt = tonumber(redis.call('get', KEYS[1]) or '1')
local seq = tonumber(ARGV[1])
if seq == nxt then
    redis.call('del', KEYS[2])
    if nxt + 1 > tonumber(redis.call('get', KEYS[5]) or '0') then
        redis.call('set', KEYS[1], nxt + 1, 'EX', ARGV[4])
        redis.call('expire', KEYS[5], ARGV[4])
        redis.call('del', KEYS[3])
        return 1
    end
    redis.call('set', KEYS[1], nxt + 1, 'EX', ARGV[2])
    return 1
end
if seq > nxt then
    redis.call('sadd', KEYS[3], seq)
    redis.call('expire', KEYS[3], ARGV[2])
end
return 0
""",
)

# KEYS[1] - alive   ARGV[1] - the task id holding the turn
# ARGV[2] - its lease in ms, extended; or 0: it stopped running (a retry, a deferral)
# return 1 if that job held the turn (now extended or released), otherwise 0
ALIVE = Script(
    "ordering_alive",
    """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
    return 0
end
if ARGV[2] == '0' then
    return redis.call('del', KEYS[1])
end
return redis.call('pexpire', KEYS[1], ARGV[2])
""",
)


def _keys(key: str) -> dict[str, str]:
    # The entity's key is the hash tag: all of its state is on one Redis Cluster slot.
    base = f"{redis_state.prefix()}order:{tagged(key)}"
    return {
        "published": f"{base}:published",
        "next": f"{base}:next",
        "skipped": f"{base}:skipped",
        "waiting": f"{base}:waiting",
        "alive": f"{base}:alive",
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
    seq = int(call(conn, PUBLISH, [_keys(key)["published"]], [STATE_TTL]))
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


def turn(
    key: str, seq: int, task_id: str, *, gap: float, lease: float, client: Any | None = None
) -> Turn:
    """May job ``seq`` (task ``task_id``) of ``key`` run now? A job that gets the turn
    is "alive" for ``lease`` seconds, unless extended (``alive_extensions``)."""
    conn = client or redis_state.client()
    names = _keys(key)
    script_keys = [names["next"], names["skipped"], names["waiting"], names["alive"]]
    gap_ms, lease_ms = int(gap * 1000), int(lease * 1000)
    args = [seq, gap_ms, STATE_TTL, task_id, max(1, lease_ms)]
    verdict, nxt = call(conn, TURN, script_keys, args)
    return Turn(run=int(verdict) != 0, next_seq=int(nxt), skipped_ahead=int(verdict) == 2)


def done(key: str, seq: int, *, task_id: str = "", client: Any | None = None) -> bool:
    """Job ``seq`` (task ``task_id``) ended for good: the next one's turn. False if it
    was not its turn (a job ahead of its turn gives its number back instead)."""
    conn = client or redis_state.client()
    names = _keys(key)
    script_keys = [names["next"], names["waiting"], names["skipped"], names["alive"]]
    script_keys.append(names["published"])
    return bool(call(conn, DONE, script_keys, [seq, STATE_TTL, task_id, IDLE_TTL]))


def release_alive(key: str, task_id: str, *, client: Any | None = None) -> bool:
    """The job holding ``key``'s turn stopped running without ending (a retry, a
    deferral): the gap clock runs again until its next attempt comes."""
    conn = client or redis_state.client()
    return bool(call(conn, ALIVE, [_keys(key)["alive"]], [task_id, 0]))


def alive_extensions(
    running: list[tuple[str, str, float]],
) -> list[tuple[Script, list[Any], list[Any]]]:
    """The calls keeping ``(ordering key, task id, lease)`` turn holders alive, for the
    worker's heartbeat pipeline (``celery_explicit.message_lease_keeper``)."""
    return [
        (ALIVE, [_keys(key)["alive"]], [task_id, max(1, int(lease * 1000))])
        for key, task_id, lease in running
    ]


def position(key: str, *, client: Any | None = None) -> tuple[int, int]:
    """(last number published, whose turn it is) for an operator."""
    conn = client or redis_state.client()
    names = _keys(key)
    published, nxt = conn.mget(names["published"], names["next"])
    return int(published or 0), int(nxt or 1)


def pass_turn_on(place: tuple[str, int] | None, *, task: str, job_id: str | None) -> None:
    """Job number ``place`` of its entity ended for good: the next one's turn."""
    import redis

    if place is None:
        return
    try:
        done(*place, task_id=job_id or "")
    except redis.RedisError:
        logger.warning(
            "ordering %s: could not pass the turn on (the next job waits out the gap)",
            place[0],
            extra={"task": task, "job_id": job_id},
        )
