"""The execution lease: one live execution per job, and a fencing token for each.

A message can be running twice. On RabbitMQ the broker hands a message to another
worker as soon as the first worker's connection drops, while its handler may still be
running. On Redis a handler that is stopped (SIGSTOP, a debugger, a long GC pause)
loses its visibility lease (``celery_explicit.lease``) and its message is handed out
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
at once (its pid is gone) and taken over without waiting for the lease to run out.

State in Redis (``EXPLICIT_REDIS_URL``):
- ``{prefix}run:{task_id}``: ``<fence>|<owner host:pid>|<acquired ms>``, with the TTL;
- ``{prefix}run-held:{task_id}``: the fence of a holder that has not released (a day);
  present while the lease is not, it means "taken over";
- ``{prefix}run-fence``: the counter.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from celery_explicit import redis_state
from celery_explicit.redis_state import PREFIX, text

logger = logging.getLogger("celery_explicit.execution_lease")

#: How long the "not released" marker outlives a lease: a holder asleep for longer
#: than this is no longer recognised as stale (its commit is then not refused).
HELD_MARKER_TTL = 24 * 3600
#: Test and incident switch: "0" runs every delivery without a lease or a fence.
ENV_SWITCH = "EXPLICIT_EXECUTION_LEASE"

# KEYS[1] - the lease          KEYS[2] - the "not released" marker
# KEYS[3] - the fence counter
# ARGV[1] - ttl ms   ARGV[2] - owner (host:pid)   ARGV[3] - now ms
# ARGV[4] - marker ttl seconds
# ARGV[5] - the value to take over from ("" unless the caller saw its holder dead)
# return {fence, previous holder's value or ""} when taken,
#        {0, holder's value, remaining ms} when held by another
ACQUIRE = """
local holder = redis.call('get', KEYS[1])
if holder and holder ~= ARGV[5] then
    return {0, holder, redis.call('pttl', KEYS[1])}
end
local previous = holder or redis.call('get', KEYS[2]) or ''
local fence = redis.call('incr', KEYS[3])
local value = fence .. '|' .. ARGV[2] .. '|' .. ARGV[3]
redis.call('set', KEYS[1], value, 'PX', ARGV[1])
redis.call('set', KEYS[2], value, 'EX', ARGV[4])
return {fence, previous}
"""

# KEYS[1] - the lease   KEYS[2] - the marker   ARGV[1] - the holder's fence
# return 1 if released, 0 if it was no longer ours
RELEASE = """
local value = redis.call('get', KEYS[2])
if value and string.match(value, '^(%d+)|') == ARGV[1] then
    redis.call('del', KEYS[1], KEYS[2])
    return 1
end
return 0
"""

# KEYS[1] - the lease   ARGV[1] - owner (host:pid)   ARGV[2] - ttl ms
# return 1 if extended, 0 if the lease is gone or held by someone else
EXTEND = """
local value = redis.call('get', KEYS[1])
if value and string.match(value, '^%d+|([^|]*)|') == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


def lease_key(task_id: str, *, prefix: str = PREFIX) -> str:
    return f"{prefix}run:{task_id}"


def marker_key(task_id: str, *, prefix: str = PREFIX) -> str:
    return f"{prefix}run-held:{task_id}"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH) != "0"


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
    #: Why it was taken over: "lease_expired" or "holder_dead" ("" when it was free).
    cause: str = ""


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _parse(value: str) -> tuple[int, str]:
    fence, holder, _acquired = value.split("|", 2)
    return int(fence), holder


def _holder_is_dead(holder: str) -> bool:
    """True when the holder ran on this host and its process no longer exists."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's process: only its lease running out tells
    return not os.path.exists(f"/proc/{pid}")


def acquire(task_id: str, *, ttl: float, client: Any | None = None) -> Taken | Held:
    """Take the job's lease, or say who holds it. One round trip on the common path."""
    conn = client or redis_state.client()
    script = redis_state.script(conn, ACQUIRE)
    keys = [lease_key(task_id), marker_key(task_id), f"{PREFIX}run-fence"]
    me, now_ms = owner(), _now_ms()
    args: list[Any] = [max(1, int(ttl * 1000)), me, now_ms, HELD_MARKER_TTL, ""]
    reply = script(keys=keys, args=args)
    if int(reply[0]) == 0:
        value = text(reply[1])
        _fence, holder = _parse(value)
        if not _holder_is_dead(holder):
            return Held(holder=holder, retry_in=max(0.0, int(reply[2]) / 1000.0))
        # Its process is gone (a killed pool child): take over now, but only from that
        # exact value, so two executions racing for it cannot both win.
        args[4] = value
        reply = script(keys=keys, args=args)
        if int(reply[0]) == 0:
            holder = _parse(text(reply[1]))[1]
            return Held(holder=holder, retry_in=max(0.0, int(reply[2]) / 1000.0))
        return Taken(fence=int(reply[0]), took_over_from=holder, cause="holder_dead")
    previous = text(reply[1])
    if not previous:
        return Taken(fence=int(reply[0]))
    return Taken(fence=int(reply[0]), took_over_from=_parse(previous)[1], cause="lease_expired")


def release(task_id: str, fence: int, *, client: Any | None = None) -> bool:
    """Give the lease back; False when it had already been taken over (logged)."""
    conn = client or redis_state.client()
    release_script = redis_state.script(conn, RELEASE)
    released = bool(release_script(keys=[lease_key(task_id), marker_key(task_id)], args=[fence]))
    if not released:
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
    calls = [[1, lease_key(task_id), holder, int(ttl * 1000)] for task_id, holder, ttl in leases]
    return sum(int(moved) for moved in redis_state.run_pipelined(client, EXTEND, calls))


def record_takeover(task_id: str, key: str, fence: int, previous: str) -> None:
    """Announce the newer fence in the database, before this execution's handler runs.

    Autocommit and upsert-to-the-larger: a stale holder's ``effect()`` reads this row
    in its commit. Written only on a takeover, so the common path never pays for it.
    """
    from django.db import connections
    from django.utils import timezone

    from django_outbox.conf import settings
    from django_outbox.models import Fence

    table = Fence._meta.db_table
    connection = connections[settings.database]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (task_id, token, idempotency_key, taken_over_from, "
            "taken_over_at) VALUES (%s, %s, %s, %s, %s) ON CONFLICT (task_id) DO UPDATE "
            "SET token = excluded.token, idempotency_key = excluded.idempotency_key, "
            "taken_over_from = excluded.taken_over_from, taken_over_at = excluded.taken_over_at "
            f"WHERE {table}.token < excluded.token",
            [task_id, fence, key[:255], previous[:255], timezone.now()],
        )


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class LiveExecution:
    """A running job's execution lease as an operator sees it (``explicit_leases``)."""

    task_id: str
    owner: str  # host:pid of the pool process running it
    fence: int
    age: float  # seconds since this execution took the lease
    expires_in: float  # seconds until another delivery may take it over


def live_executions(client: Any, *, prefix: str = PREFIX) -> list[LiveExecution]:
    """Every execution lease in Redis, soonest to expire first."""
    now_ms = _now_ms()
    found = []
    for task_id, value, ttl_ms in redis_state.live_strings(client, f"{prefix}run:"):
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
