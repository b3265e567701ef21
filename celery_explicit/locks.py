"""Lease locks: expiry, an owner token, compare-and-act scripts, a fencing token.

A lock that never expires stays held by a dead process forever; a lock released with
GET-then-DEL can delete the lock a second owner took in between. Here a lock always has
a TTL, only its owner (the random token it got at acquisition) can release or extend
it, each of those is one atomic Lua step (a Redis function, or a script where functions are
unavailable), and every acquisition gets a fencing token: a
number that only grows, so a write can refuse a holder that lost its lock while paused
(``django_outbox.store.guarded_writes.fenced_update``). An acquisition whose reply was lost, sent
again by redis-py's retry, finds its own value and gets its fence back: it is not
refused by the lock it set itself.

    lock = LeaseLock(redis_client, "rebuild:user:123", ttl=30.0)
    with lock.hold(wait=5.0) as fence:
        rebuild(user_id=123, fencing_token=fence)
        lock.extend()        # still working: push the expiry forward

State in Redis, per lock, with the lock's name as the hash tag (one Redis Cluster slot):
a string ``{prefix}lock:{<name>}`` holding ``<token>|0|<acquired_ms>|<owner>`` with
the TTL, and a counter ``{prefix}fence:{<name>}`` given the same TTL by every
acquisition and extension: it expires when no lock of that name can be alive. A
counter that does not exist starts at the server's clock in microseconds, not at 0,
so a counter that expired or was lost (a flush, a failover to a replica that never
had it) never hands out a token below one already handed out and written with
``fenced_update``: each token costs a script call, which takes the server more than a
microsecond, so a counter grows slower than the clock it started from. (What that
assumes: the server's clock does not step back by more than the time since the old
counter started.) A name's state is gone once its lock has expired or been released
and its TTL has passed; counters written by versions before the expiry have none, and
get one at their name's next acquisition.

While the lock exists its holder's fence is the counter's value: only an acquisition
that set the lock increments it. So the value does not carry the fence (building that
string in Lua cost Redis a fifth of the acquisition); its second field, the fence in
the values earlier versions wrote, is 0, and stays so that an older ``explicit_locks``
still parses the value during a rolling deploy (it shows such a lock's fence as 0).
``live_locks`` reads both formats; it shows 0 too for a lock whose counter was deleted
(an eviction policy that evicts keys without a TTL) while it was held.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from celery_explicit import job_log, metrics, redis_state
from celery_explicit.errors import (
    LockConfigError,
    LockNotAcquired,
    LockNotOwned,
    LockNotReplicated,
)
from celery_explicit.redis_scripts import Script, call, tagged
from celery_explicit.redis_state import live_strings

logger = job_log.get_logger("celery_explicit.locks")


# The lock's value starts with the 32-character owner token, which release and extend
# compare; the client writes all of it, so taking the lock is one SET NX PX.

# KEYS[1] - the lock
# KEYS[2] - the fencing counter (expires with the lock)
# ARGV[1] - the lock's value: "<token>|0|<acquired_ms>|<owner>"
# ARGV[2] - ttl in milliseconds
# return the new fencing token if acquired, otherwise false; the counter's error, with
# the lock taken back, if it cannot be incremented
#
# The token is above the server's clock in microseconds as well as above the counter:
# a counter that is gone (expired, or never replicated before a failover promoted a
# replica) or behind (a replica that got only an older value) restarts at the clock,
# which is past every token handed out before as long as the new primary's clock is
# not behind the old one's by more than the failover took (seconds, with Sentinel).
# LeaseLock(replicas=N) makes it strict where replicas exist: the token is handed out
# only once N replicas hold it (WAIT), so the replica a failover promotes has it.
ACQUIRE = Script(
    "lock_acquire",
    """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    if redis.call('get', KEYS[1]) == ARGV[1] then
        -- This very acquisition, sent again: its reply was lost and the client retried
        -- (redis-py does on a dropped connection). It holds the lock: its fence.
        return tonumber(redis.call('get', KEYS[2]))
    end
    return false
end
local fence = redis.pcall('incr', KEYS[2])
if type(fence) == 'table' and fence.err then
    -- A counter that is not one (WRONGTYPE): no lock held by a token nobody has.
    redis.call('del', KEYS[1])
    return fence
end
local now = redis.call('time')
local clock = now[1] .. string.format('%06d', tonumber(now[2]))
if fence <= tonumber(clock) then
    redis.call('set', KEYS[2], clock)
    fence = redis.call('incr', KEYS[2])
end
redis.call('pexpire', KEYS[2], ARGV[2])
return fence
""",
)

# KEYS[1] - the lock
# ARGV[1] - owner token
# return 1 if released, otherwise 0
RELEASE = Script(
    "lock_release",
    """
local value = redis.call('get', KEYS[1])
if value and string.sub(value, 1, 32) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
""",
)

# KEYS[1] - the lock   KEYS[2] - the fencing counter (extended with the lock)
# ARGV[1] - owner token
# ARGV[2] - new ttl in milliseconds, counted from now
# return 1 if extended, otherwise 0
EXTEND = Script(
    "lock_extend",
    """
local value = redis.call('get', KEYS[1])
if value and string.sub(value, 1, 32) == ARGV[1] then
    redis.call('pexpire', KEYS[2], ARGV[2])
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
""",
)


@dataclass(frozen=True)
class LiveLock:
    """A lock as an operator sees it (``manage.py explicit_locks``)."""

    name: str
    owner: str
    fence: int
    age: float  # seconds since acquisition
    expires_in: float  # seconds until Redis drops it


class LeaseLock:
    """One named lock. Not reentrant; one instance per holder (it keeps the token)."""

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        ttl: float,
        prefix: str | None = None,
        replicas: int = 0,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
            raise LockConfigError(
                name, f"Lock {name}: ttl must be a positive number of seconds, got {ttl!r}"
            )
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise LockConfigError(
                name, f"Lock {name}: replicas must be an integer >= 0, got {replicas!r}"
            )
        # Replicas that must hold the token before it is handed out (a failover then
        # promotes one that has it); 0 trusts the server's clock alone (see ACQUIRE).
        self.replicas = replicas
        if not name:
            raise LockConfigError(name, "a lock needs a non-empty name")
        self.client = client
        self.name = name
        self.ttl = float(ttl)
        head = prefix or redis_state.prefix()
        self.key = f"{head}lock:{tagged(name)}"
        self.fence_key = f"{head}fence:{tagged(name)}"
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.token: str | None = None
        self.fence: int | None = None
        # Resolved once: on the hot path a lock is a few round trips, and label
        # look-ups and duration conversions would show next to them
        # (bench/lock_round_trips.py).
        self._ttl_ms = _ms(self.ttl)
        self._wait_seconds = metrics.lock_wait_seconds.labels(_family(name))

    def acquire(self, *, wait: float = 0.0) -> int:
        """Take the lock, waiting up to ``wait`` seconds; return the fencing token.

        Raises ``LockNotAcquired`` (with the time waited) when it is still held by
        someone else after ``wait``. Polls with jitter, so waiters do not wake together.
        """
        token = os.urandom(16).hex()
        start = time.monotonic()
        deadline = start + max(0.0, wait)
        pause = 0.01
        while True:
            fence = call(
                self.client,
                ACQUIRE,
                [self.key, self.fence_key],
                [f"{token}|0|{int(time.time() * 1000)}|{self.owner}", self._ttl_ms],
            )
            if fence:
                self.token, self.fence = token, int(fence)
                if self.replicas:
                    self._wait_for_replicas(deadline)
                waited = time.monotonic() - start
                self._wait_seconds.observe(waited)
                if job_log.in_job():
                    # Its attempt line names the lock it took. Whole microseconds, in
                    # ms: round(x, 3) costs as much as a tenth of this method.
                    job_log.update(
                        lock_key=self.name,
                        owner_token=token,
                        fencing_token=self.fence,
                        lock_wait_ms=int(waited * 1e6) / 1000,
                    )
                return self.fence
            now = time.monotonic()
            if now >= deadline:
                metrics.lock_not_acquired.labels(_family(self.name)).inc()
                raise LockNotAcquired(self.name, waited=now - start)
            time.sleep(min(random.uniform(pause / 2, pause), deadline - now))
            pause = min(pause * 2, 0.5)

    def _wait_for_replicas(self, deadline: float) -> None:
        # WAIT blocks this connection until the replicas acknowledged every write made
        # on it so far, the acquisition included; at least a tenth of the TTL, so a
        # zero ``wait`` still gives replication a round trip.
        timeout_ms = max(int((deadline - time.monotonic()) * 1000), self._ttl_ms // 10, 1)
        acknowledged = int(self.client.execute_command("WAIT", self.replicas, timeout_ms))
        if acknowledged < self.replicas:
            with suppress(Exception):  # it expires anyway; the error says why
                self.release()
            self.token = self.fence = None
            raise LockNotReplicated(self.name, replicas=self.replicas, acknowledged=acknowledged)

    def release(self) -> None:
        """Release, only if this token still owns the lock; else ``LockNotOwned``."""
        token = self._owned_token("release")
        self.token = None
        if not call(self.client, RELEASE, [self.key], [token]):
            self._lost("release", token)

    def extend(self, ttl: float | None = None) -> None:
        """Set the expiry to ``ttl`` (default: the lock's ttl) from now, if still owned."""
        token = self._owned_token("extend")
        if ttl is None:
            ttl_ms = self._ttl_ms
        elif isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
            raise LockConfigError(
                self.name,
                f"Lock {self.name}: cannot extend by {ttl!r}: ttl must be positive seconds",
            )
        else:
            ttl_ms = _ms(ttl)
        if not call(self.client, EXTEND, [self.key, self.fence_key], [token, ttl_ms]):
            self.token = None
            self._lost("extend", token)

    @contextmanager
    def hold(self, *, wait: float = 0.0) -> Iterator[int]:
        """``acquire`` on entry (yields the fencing token), ``release`` on exit.

        If the lock expired while held, leaving the block raises ``LockNotOwned``: the
        work inside ran without the lock for a while, and the caller must know.
        """
        fence = self.acquire(wait=wait)
        try:
            yield fence
        except BaseException:
            # The block's own error wins: a lost lock is logged and counted, not raised
            # over it (a retryable error must stay retryable).
            if self.token is not None:
                with suppress(LockNotOwned):
                    self.release()
            raise
        if self.token is not None:
            self.release()

    def _owned_token(self, action: str) -> str:
        if self.token is None:
            raise LockNotOwned(self.name, action=action, token=None)
        return self.token

    def _lost(self, action: str, token: str) -> None:
        metrics.locks_lost.labels(_family(self.name), action).inc()
        logger.warning(
            "lock %s lost before %s",
            self.name,
            action,
            extra={
                "lock_key": self.name,
                "owner_token": token,
                "fencing_token": self.fence,
                "action": action,
            },
        )
        raise LockNotOwned(self.name, action=action, token=token)


def live_locks(client: Any, *, prefix: str | None = None) -> list[LiveLock]:
    """Every lock currently held, with owner, age and time left."""
    now_ms = time.time() * 1000
    head = prefix or redis_state.prefix()
    found = []
    for name, value, ttl_ms, counter in live_strings(client, f"{head}lock:", also=f"{head}fence:"):
        _token, fence, acquired_ms, owner = value.split("|", 3)
        found.append(
            LiveLock(
                name=name,
                owner=owner,
                # 0: written by this version, whose holder's fence is the counter's.
                fence=int(fence) or int(counter or 0),
                age=max(0.0, (now_ms - int(acquired_ms)) / 1000.0),
                expires_in=ttl_ms / 1000.0,
            )
        )
    return sorted(found, key=lambda lock: lock.name)


def _ms(seconds: float) -> int:
    # Durations are seconds in the API, milliseconds only at the Redis call.
    return max(1, int(seconds * 1000))


def _family(name: str) -> str:
    """Metric label: the lock name up to its first ':' ("rebuild" for rebuild:user:1),
    so a label per entity does not explode the series count."""
    return name.split(":", 1)[0]
