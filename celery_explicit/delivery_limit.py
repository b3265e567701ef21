"""Delivery limit: a message delivered too many times goes to the dead letters.

Celery counts retries, not deliveries. A message whose handler kills its worker (out of
memory, a segfault in a C extension) is requeued on worker loss
(``reject_on_worker_lost``) and delivered again, forever, taking a worker down each
time (celery#9082). Each redelivered ExplicitTask message (the broker flags it) is
counted before the handler runs; past ``max_deliveries`` (default 5, the first
delivery included) it is dead-lettered with reason ``delivery_limit`` instead of being
run again. First deliveries are not counted, so the common path costs nothing.

The count is per message: task id and retry number (a retry is a new message). It
lives in Redis (``EXPLICIT_REDIS_URL``) as ``{prefix}redeliveries:{task_id}:{retries}``
and expires a day after the last delivery.
"""

from __future__ import annotations

from typing import Any

from celery_explicit import redis_state
from celery_explicit.redis_state import PREFIX

COUNT_TTL = 24 * 3600


def count_key(task_id: str, retries: int, *, prefix: str = PREFIX) -> str:
    return f"{prefix}redeliveries:{task_id}:{retries}"


def count_delivery(task_id: str, retries: int, *, redis_client: Any | None = None) -> int:
    """Add this redelivery to the message's count; return the count including it."""
    conn = redis_client or redis_state.client()
    pipe = conn.pipeline()
    key = count_key(task_id, retries)
    pipe.incr(key)
    pipe.expire(key, COUNT_TTL)
    count, _ = pipe.execute()
    return int(count)
