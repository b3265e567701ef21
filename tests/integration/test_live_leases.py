"""What ``manage.py explicit_leases`` shows of a message lease, against real Redis.

A heartbeat can move a lease's deadline while the listing reads it. Time left is
counted from a clock read after the record, so it never shows more than the lease's
length: an operator who sees "2.3 s left" on a 2 s lease would rightly distrust it.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis

from celery_explicit.message_lease import live_leases
from celery_explicit.redis_scripts import server_time

LEASE_MS = 2000


class HeartbeatDuringRead:
    """A client whose every record read is preceded by a heartbeat of that record: the
    deadline moved to now + the lease, as ``message_lease_extend`` writes it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def scan_iter(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.scan_iter(*args, **kwargs)

    def time(self) -> Any:
        return self.client.time()

    def hgetall(self, key: str) -> Any:
        # The server's clock, as the lease script writes the deadline.
        self.client.hset(key, "deadline_ms", int(server_time(self.client) * 1000) + LEASE_MS)
        self.client.hincrby(key, "extensions", 1)
        return self.client.hgetall(key)


def test_time_left_never_exceeds_the_lease_when_a_heartbeat_races_the_read(
    redis_client: redis.Redis,
) -> None:
    prefix = f"explicit-test-live-{uuid.uuid4().hex[:8]}:"
    tasks = [f"task-{i}" for i in range(20)]
    for task_id in tasks:
        # A deadline in the past: only the racing heartbeat gives it time left.
        redis_client.hset(
            f"{prefix}lease:{task_id}",
            mapping={"owner": "host:1", "deadline_ms": 0, "extensions": 0, "tag": task_id},
        )
    try:
        listed = live_leases(HeartbeatDuringRead(redis_client), prefix=prefix)
    finally:
        redis_client.delete(*(f"{prefix}lease:{t}" for t in tasks))
    assert sorted(lease.task_id for lease in listed) == sorted(tasks)
    assert all(lease.extensions == 1 for lease in listed)
    shown = [lease.expires_in for lease in listed]
    assert all(LEASE_MS / 1000 - 0.5 < left <= LEASE_MS / 1000 for left in shown), shown
