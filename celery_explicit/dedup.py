"""Explicit dedup: drop a second message that carries an id already seen, for a while.

Dedup is not idempotency. Dedup drops a second *message* carrying a known message or
event id inside a window, to spare the work of an upstream resend; idempotency makes a
second *execution* of the same effect harmless, forever, and is what guarantees the
effect happens once (a message outside the window, or one that dedup never saw, is
still stopped by the effect ledger).

A task declares ``dedup_key = "{event_id}"`` (a template over ``run()``'s parameters,
or a callable) and ``dedup_window`` (seconds). The first message to claim an id owns
it for the window: a later message with the same id is dropped at publish (nothing is
sent; the caller gets the owner's result handle) or, if it reached the broker another
way, at delivery (recorded as an attempt with outcome ``deduplicated``). Retries and
redeliveries keep their task id, so they are never dropped; replays from the dead
letters skip dedup.
"""

from __future__ import annotations

from typing import Any

from celery_explicit import redis_state
from celery_explicit.redis_state import PREFIX, client, text

# KEYS[1] - the dedup mark for one (task, id)
# ARGV[1] - the task id claiming it
# ARGV[2] - window in milliseconds
# return the task id that owns the id: ARGV[1] if this call claimed it, else the owner
CLAIM = """
local owner = redis.call('get', KEYS[1])
if owner then
    return owner
end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""

# KEYS[1] - the dedup mark
# ARGV[1] - the task id that claimed it
# return 1 if this task's claim was removed, otherwise 0 (someone else's claim stays)
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


def mark_key(task_name: str, dedup_id: str, *, prefix: str = PREFIX) -> str:
    return f"{prefix}dedup:{task_name}:{dedup_id}"


def claim(
    task_name: str, dedup_id: str, task_id: str, *, window: float, redis_client: Any | None = None
) -> str:
    """Claim ``dedup_id`` for ``task_id``; return the task id that owns it."""
    conn = redis_client or client()
    claim_script = redis_state.script(conn, CLAIM)
    window_ms = max(1, int(window * 1000))
    owner = claim_script(keys=[mark_key(task_name, dedup_id)], args=[task_id, window_ms])
    return text(owner)


def release(
    task_name: str, dedup_id: str, task_id: str, *, redis_client: Any | None = None
) -> bool:
    """Give back a claim whose message was never published (compare-and-delete)."""
    conn = redis_client or client()
    release_script = redis_state.script(conn, RELEASE)
    return bool(release_script(keys=[mark_key(task_name, dedup_id)], args=[task_id]))
