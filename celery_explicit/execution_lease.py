"""The execution lease: one live execution per job, and a fencing token for each.

A message can be running twice. On RabbitMQ the broker hands a message to another
worker as soon as the first worker's connection drops, while its handler may still be
running. On Redis a handler that is stopped (SIGSTOP, a debugger, a long GC pause)
loses its visibility lease (``celery_explicit.message_lease``) and its message is handed out
again; when the first one wakes up, two executions are live.

So before the handler runs, the execution takes a lease on its job (the task id):

- held by a live execution: this delivery is deferred (re-published for later, same
  task id), never run concurrently and never blocking a pool slot;
- free: taken, with a fencing token from one counter that only grows;
- not released by the previous holder (its lease ran out, or its process is gone):
  taken over, and the takeover is written to the database (``django_outbox.Fence``).
  The previous holder, if it wakes up, has its effect's commit refused
  (``effect()`` reads the fence in the same transaction) and its attempt is recorded
  as ``fenced``.

The lease lasts the task's ``visibility_timeout`` and is extended every ``T / 4`` by
the worker's main process while the handler's process is alive and not stopped (the
same ``LeaseKeeper`` as the visibility lease). A dead holder on this host is detected
at once (its pid is gone, or is a zombie its parent has not reaped yet) and taken over
without waiting for the lease to run out.

State in Redis (``EXPLICIT_REDIS_URL``), the three keys of a job sharing its task id as
their hash tag (one slot on Redis Cluster):
- ``{prefix}run:{<task_id>}``: ``<fence>|<owner host:pid>|<acquired ms>``, with the TTL;
- ``{prefix}run-held:{<task_id>}``: the fence of a holder that has not released (a
  day); present while the lease is not, it means "taken over";
- ``{prefix}run-fence:{<task_id>}``: the job's fence counter. A token is above the
  counter and above the server's clock in microseconds, so a counter that expired, was
  deleted or was lost in a failover never hands out a token below an older one: each
  token costs a script call, which takes the server more than a microsecond, so a
  counter grows slower than the clock. (After a failover that lost ``run:`` and
  ``run-held:`` no takeover is seen; the ledger still applies the effect once.)

All three are deleted by the release that ends an execution, in one script: a
finished job leaves nothing. A later delivery of the same job (a retry, a deferral, a
duplicate) starts a new counter, above every token the old one gave. Only an execution
that never released (its process killed, its Redis unreachable at the end) leaves its
marker and counter, for ``HELD_MARKER_TTL`` at most: the next delivery of that job takes
over and releases them, so they number the crashes, not the jobs.

This module is the lease itself: its scripts and keys, taking, releasing and extending
it, and listing the live ones. The step that takes it before the handler runs (deferring
a delivery, recording a takeover) is ``celery_explicit.execution_lease_step``.
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass
from typing import Any

from celery_explicit import job_log, redis_state
from celery_explicit.conf import settings
from celery_explicit.redis_scripts import (
    SERVER_NOW_MS,
    Script,
    call,
    call_many,
    server_time,
    tagged,
)
from celery_explicit.redis_state import text

logger = job_log.get_logger("celery_explicit.execution_lease")

#: How long the "not released" marker outlives a lease: a holder asleep for longer
#: than this is no longer recognised as stale (its commit is then not refused).
HELD_MARKER_TTL = 24 * 3600

# KEYS[1] - the lease          KEYS[2] - the "not released" marker
# KEYS[3] - the job's fence counter
# ARGV[1] - ttl ms   ARGV[2] - owner (host:pid)
# ARGV[3] - marker and counter ttl seconds
# ARGV[4] - the value to take over from ("" unless the caller saw its holder dead)
# The value records when it was taken, on the server's clock (an operator's "age").
# return {fence, previous holder's value or ""} when taken,
#        {0, holder's value, remaining ms} when held by another
ACQUIRE = Script(
    "execution_lease_acquire",
    SERVER_NOW_MS
    + """
local holder = redis.call('get', KEYS[1])
if holder and holder ~= ARGV[4] then
    return {0, holder, redis.call('pttl', KEYS[1])}
end
local previous = holder or redis.call('get', KEYS[2]) or ''
local fence = redis.call('incr', KEYS[3])
local clock = server_time[1] .. string.format('%06d', tonumber(server_time[2]))
if fence <= tonumber(clock) then
    -- A counter gone or behind (expired, deleted, lost in a failover): the clock's.
    redis.call('set', KEYS[3], clock)
    fence = redis.call('incr', KEYS[3])
end
redis.call('expire', KEYS[3], ARGV[3])
-- '%.0f': Lua would write a number this large as 1.7e+15.
local value = string.format('%.0f', fence) .. '|' .. ARGV[2] .. '|' .. string.format('%.0f', now_ms)
redis.call('set', KEYS[1], value, 'PX', ARGV[1])
redis.call('set', KEYS[2], value, 'EX', ARGV[3])
return {fence, previous}
""",
)

# KEYS[1] - the lease   KEYS[2] - the marker   KEYS[3] - the job's fence counter
# ARGV[1] - the holder's fence
# return 1 if released (the three keys deleted), 0 if another execution's lease or
#   marker is there (taken over), 2 if neither is (gone: lost in a failover, or taken
#   over by an execution that has ended since; only the database tells which)
# The counter goes with the lease: no execution of the job holds a token any more (an
# earlier holder that never released was taken over, and its marker is this one's),
# and a counter made again starts at the server's clock, above every token it gave.
RELEASE = Script(
    "execution_lease_release",
    """
local value = redis.call('get', KEYS[2])
if value and string.match(value, '^(%d+)|') == ARGV[1] then
    redis.call('del', KEYS[1], KEYS[2], KEYS[3])
    return 1
end
if not value and redis.call('exists', KEYS[1]) == 0 then
    return 2
end
return 0
""",
)

# KEYS[1] - the lease   ARGV[1] - owner (host:pid)   ARGV[2] - ttl ms
# return 1 if extended, 0 if the lease is gone or held by someone else
EXTEND = Script(
    "execution_lease_extend",
    """
local value = redis.call('get', KEYS[1])
if value and string.match(value, '^%d+|([^|]*)|') == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
""",
)


def lease_key(task_id: str, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}run:{tagged(task_id)}"


def marker_key(task_id: str, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}run-held:{tagged(task_id)}"


def fence_key(task_id: str, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}run-fence:{tagged(task_id)}"


def enabled() -> bool:
    """``EXPLICIT_EXECUTION_LEASE`` (setting or environment): off runs every delivery
    without a lease or a fence (an incident switch, and the tests' negative control)."""
    return settings.execution_lease


class TakeoverCause(enum.StrEnum):
    """Why a lease was taken over from an execution that never released it."""

    #: It ran out: its holder stopped extending it (paused, partitioned, killed elsewhere).
    LEASE_EXPIRED = "lease_expired"
    #: Its holder ran on this host and its process is gone (a killed pool child).
    HOLDER_DEAD = "holder_dead"


@dataclass(frozen=True)
class Held:
    """The lease is held by a live execution; try again in ``retry_in`` seconds."""

    holder: str  # host:pid
    retry_in: float


@dataclass(frozen=True)
class Taken:
    """This execution holds the lease with ``fence``; ``took_over_from`` when stale."""

    fence: int
    took_over_from: str = ""  # host:pid of a holder that never released
    #: Why it was taken over (None when it was free).
    cause: TakeoverCause | None = None
    #: When the holder taken over took its lease (epoch ms, the Redis server's clock):
    #: the start of an execution that may have left no other trace (a killed process).
    holder_started_ms: int | None = None


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _parse(value: str) -> tuple[int, str]:
    fence, holder, _acquired = value.split("|", 2)
    return int(fence), holder


def _acquired_ms(value: str) -> int | None:
    """When the holder of lease value ``value`` took it (epoch ms); None if unreadable."""
    acquired = value.rsplit("|", 1)[-1]
    return int(acquired) if acquired.isdigit() else None


def process_state(pid: int) -> bytes | None:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (R, S, T, Z, ...);
    None when there is no such process or its state cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # Format: pid (comm) state ...; comm may hold spaces, so split after ')'.
            return bytes(stat.read().rsplit(b")", 1)[1].split()[0])
    except (OSError, IndexError):
        return None


def process_is_gone(pid: int) -> bool:
    """True when process ``pid`` no longer runs: it does not exist, or it has exited and
    its parent has not reaped it yet (a zombie, state Z, keeps its /proc entry until
    then: a SIGKILLed pool child until the pool notices, seconds later)."""
    state = process_state(pid)
    if state is None:
        return not os.path.exists(f"/proc/{pid}")  # exists but unreadable: not gone
    return state in (b"Z", b"X", b"x")


def _holder_is_dead(holder: str) -> bool:
    """True when the holder ran on this host and its process no longer runs."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's process: only its lease running out tells
    return process_is_gone(int(pid))


def acquire(task_id: str, *, ttl: float, client: Any | None = None) -> Taken | Held:
    """Take the job's lease, or say who holds it. One round trip on the common path."""
    conn = client or redis_state.client()
    head = redis_state.prefix()
    keys = [lease_key(task_id, prefix=head), marker_key(task_id, prefix=head)]
    keys.append(fence_key(task_id, prefix=head))
    args: list[Any] = [max(1, int(ttl * 1000)), owner(), HELD_MARKER_TTL, ""]
    reply = call(conn, ACQUIRE, keys, args)
    if int(reply[0]) == 0:
        value = text(reply[1])
        _fence, holder = _parse(value)
        if not _holder_is_dead(holder):
            return Held(holder=holder, retry_in=max(0.0, int(reply[2]) / 1000.0))
        # Its process is gone (a killed pool child): take over now, but only from that
        # exact value, so two executions racing for it cannot both win.
        args[3] = value
        reply = call(conn, ACQUIRE, keys, args)
        if int(reply[0]) == 0:
            holder = _parse(text(reply[1]))[1]
            return Held(holder=holder, retry_in=max(0.0, int(reply[2]) / 1000.0))
        return Taken(
            fence=int(reply[0]),
            took_over_from=holder,
            cause=TakeoverCause.HOLDER_DEAD,
            holder_started_ms=_acquired_ms(value),
        )
    previous = text(reply[1])
    if not previous:
        return Taken(fence=int(reply[0]))
    previous_holder = _parse(previous)[1]
    # The lease ran out before this delivery came (a whole worker killed: its message
    # came back only once its visibility lease ran out). A holder on this host whose
    # process is gone died; only one elsewhere, or one alive but stopped, merely expired.
    dead = _holder_is_dead(previous_holder)
    return Taken(
        fence=int(reply[0]),
        took_over_from=previous_holder,
        cause=TakeoverCause.HOLDER_DEAD if dead else TakeoverCause.LEASE_EXPIRED,
        holder_started_ms=_acquired_ms(previous),
    )


class Released(enum.IntEnum):
    """What a release found. False only when taken over: ``if release(...)`` reads as
    "nobody else holds it"."""

    TAKEN_OVER = 0
    RELEASED = 1
    #: Neither its lease nor its marker: a Redis failover lost them, or an execution
    #: that took it over has ended since (its release deleted them). The database's
    #: fence rows tell which (``execution_lease_step.give_back``).
    GONE = 2


def release(task_id: str, fence: int, *, client: Any | None = None) -> Released:
    """Give the lease back; ``TAKEN_OVER`` (logged) when another execution holds it."""
    conn = client or redis_state.client()
    head = redis_state.prefix()  # one settings read per job, not one per key
    keys = [
        lease_key(task_id, prefix=head),
        marker_key(task_id, prefix=head),
        fence_key(task_id, prefix=head),
    ]
    released = Released(int(call(conn, RELEASE, keys, [fence])))
    if released is Released.TAKEN_OVER:
        logger.warning(
            "execution lease of job %s (fence %s) was taken over before it ended",
            task_id,
            fence,
        )
    return released


def extend_all(client: Any, leases: list[tuple[str, str, float]]) -> int:
    """Extend ``(task_id, owner, ttl)`` leases in one pipeline; return how many moved."""
    if not leases:
        return 0
    return sum(int(moved) for moved in call_many(client, extensions(leases)))


def extensions(leases: list[tuple[str, str, float]]) -> list[tuple[Script, list[Any], list[Any]]]:
    """The calls extending ``(task_id, owner, ttl)`` leases, for one pipeline."""
    head = redis_state.prefix()
    return [
        (EXTEND, [lease_key(task_id, prefix=head)], [holder, int(ttl * 1000)])
        for task_id, holder, ttl in leases
    ]


@dataclass(frozen=True)
class LiveExecution:
    """A running job's execution lease as an operator sees it (``explicit_leases``)."""

    task_id: str
    owner: str  # host:pid of the pool process running it
    fence: int
    age: float  # seconds since this execution took the lease
    expires_in: float  # seconds until another delivery may take it over


def live_executions(client: Any, *, prefix: str | None = None) -> list[LiveExecution]:
    """Every execution lease in Redis, soonest to expire first."""
    now_ms = server_time(client) * 1000  # the leases record the server's clock
    found = []
    head = f"{prefix or redis_state.prefix()}run:"
    for task_id, value, ttl_ms, _ in redis_state.live_strings(client, head):
        fence, holder = _parse(value)
        acquired_ms = int(value.rsplit("|", 1)[1])
        found.append(
            LiveExecution(
                task_id=task_id,
                owner=holder,
                fence=fence,
                age=max(0.0, (now_ms - acquired_ms) / 1000.0),
                expires_in=ttl_ms / 1000.0,
            )
        )
    return sorted(found, key=lambda lease: lease.expires_in)
