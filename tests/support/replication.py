"""A private Redis primary and replica on loopback, with the replication link through a
proxy, for what a failover loses.

Redis replicates asynchronously: a write the primary acknowledged may not have reached
the replica when the primary dies and the replica is promoted (by Sentinel, or by a
managed Redis). ``sever()`` makes that window as wide as a test needs: the replica's
link stays up but nothing the primary sends arrives. ``fail_over()`` kills the primary
and promotes the replica, what Sentinel does after ``down-after-milliseconds``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from celery_explicit.errors import StaleFencingToken
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script
from django_outbox.store.guarded_writes import fenced_update
from tests.support.proxy import CuttableProxy
from tests.support.servers import PrivateRedis


class PrimaryReplica:
    def __init__(self, data_dir: Path) -> None:
        # No delay before a full sync (Redis waits 5 s for more replicas by default).
        self.primary = PrivateRedis(
            data_dir / "primary", durable=False, extra=["--repl-diskless-sync-delay", "0"]
        )
        self.primary.start()
        self.link = CuttableProxy(("127.0.0.1", self.primary.port))
        self.replica = PrivateRedis(
            data_dir / "replica",
            durable=False,
            extra=[
                "--replicaof", "127.0.0.1", str(self.link.port),
                # What others (Sentinel) reach the replica at, not the proxy's side.
                "--replica-announce-ip", "127.0.0.1",
            ],
        )  # fmt: skip
        self.replica.start()
        self.promoted = False
        self.wait_in_sync()

    def client(self) -> redis.Redis:
        """A client of whichever server is the primary now."""
        server = self.replica if self.promoted else self.primary
        return redis.Redis.from_url(server.url)

    def wait_in_sync(self, timeout: float = 10.0) -> None:
        """Until the replica's link is up and it has everything the primary wrote."""
        primary = redis.Redis.from_url(self.primary.url)
        replica = redis.Redis.from_url(self.replica.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = replica.info("replication")
            offset = primary.info("replication")["master_repl_offset"]
            if info.get("master_link_status") == "up" and info["slave_repl_offset"] >= offset:
                return
            time.sleep(0.05)
        raise TimeoutError(f"the replica did not catch up within {timeout} s")

    def sever(self) -> None:
        """From now on nothing the primary sends reaches the replica."""
        self.link.dropping = True

    def fail_over(self) -> None:
        """Kill the primary and promote the replica."""
        self.primary.kill()
        redis.Redis.from_url(self.replica.url).execute_command("REPLICAOF", "NO", "ONE")
        self.promoted = True

    def stop(self) -> None:
        self.link.close()
        for server in (self.replica, self.primary):
            if server.process is not None:
                server.stop()


def tokens(fence_a: int, fence_b: int) -> str:
    """How B's token, taken after the failover, stands to A's, taken before it."""
    if fence_b > fence_a:
        return "B's token larger"
    return "token handed out twice" if fence_b == fence_a else "token went backwards"


def stale_write(rows: Any, fence_a: int, fence_b: int) -> str:
    """B writes with its token, then A with its stale one: what became of A's write."""
    fenced_update(rows, token=fence_b, data="B")
    try:
        fenced_update(rows, token=fence_a, data="A")
    except StaleFencingToken:
        return "stale write refused"
    return "stale write applied" if rows.get().data == "A" else "newer write kept"


# The negative controls' scripts: the acquisitions as they were, the counter seeded from
# the server clock only when missing, so a counter a failover rolled back repeats a token.
COUNTER_ONLY = Script(
    "lock_acquire_counter_only_control",
    """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return false
end
if redis.call('exists', KEYS[2]) == 0 then
    local now = redis.call('time')
    redis.call('set', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
end
local fence = redis.call('incr', KEYS[2])
redis.call('pexpire', KEYS[2], ARGV[2])
return fence
""",
)


EXECUTION_COUNTER_ONLY = Script(
    "execution_lease_acquire_counter_only_control",
    SERVER_NOW_MS
    + """
local holder = redis.call('get', KEYS[1])
if holder and holder ~= ARGV[4] then
    return {0, holder, redis.call('pttl', KEYS[1])}
end
local previous = holder or redis.call('get', KEYS[2]) or ''
if redis.call('exists', KEYS[3]) == 0 then
    redis.call('set', KEYS[3], server_time[1] .. string.format('%06d', tonumber(server_time[2])))
end
local fence = redis.call('incr', KEYS[3])
redis.call('expire', KEYS[3], ARGV[3])
local value = string.format('%.0f', fence) .. '|' .. ARGV[2] .. '|' .. string.format('%.0f', now_ms)
redis.call('set', KEYS[1], value, 'PX', ARGV[1])
redis.call('set', KEYS[2], value, 'EX', ARGV[3])
return {fence, previous}
""",
)
