"""Where the contracts keep their state in Redis: one key prefix, one client per process.

Dedup marks, delivery counts and downstream limits live in the Redis named by
``EXPLICIT_REDIS_URL`` (by default the broker, when it is Redis). Locks and leases take
their client from the caller (locks) or the broker connection (leases) but share the
prefix, so an operator finds everything under ``explicit:``.
"""

from __future__ import annotations

import threading
from typing import Any

PREFIX = "explicit:"

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """The Redis client for ``EXPLICIT_REDIS_URL``, one per URL and process."""
    import redis

    from django_outbox.conf import settings

    url = settings.redis_url
    with _clients_lock:
        if url not in _clients:
            _clients[url] = redis.Redis.from_url(url)
        return _clients[url]


def text(value: Any) -> str:
    """A Redis reply (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
