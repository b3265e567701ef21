"""Where the contracts keep their state in Redis: one key prefix, one client per process.

Dedup marks, delivery counts, ordering, downstream limits and execution leases live in
the Redis named by ``EXPLICIT_REDIS_URL`` (by default the broker, when it is Redis).
Locks take their client from the caller and message leases the broker's; every key we
write starts with ``EXPLICIT_KEY_PREFIX`` (default ``explicit:``), so an operator finds
everything under it. Lua goes through ``celery_explicit.redis_scripts``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from celery_explicit.conf import settings

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def prefix() -> str:
    """``EXPLICIT_KEY_PREFIX``: the head of every key we write."""
    return settings.key_prefix


def client() -> Any:
    """The Redis client for ``EXPLICIT_REDIS_URL``, one per URL and process."""
    import redis

    url = settings.redis_url
    with _clients_lock:
        if url not in _clients:
            # Timeouts: the worker's main loop extends leases with this client, and
            # a Redis that stops answering must not stall it.
            _clients[url] = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        return _clients[url]


def text(value: Any) -> str:
    """A Redis reply (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def untag(name: str) -> str:
    """A name as it was given, from a key part written as a hash tag (``{name}``)."""
    return name[1:-1] if name.startswith("{") and name.endswith("}") else name


def live_strings(client: Any, head: str) -> Iterator[tuple[str, str, int]]:
    """(name after ``head``, value, milliseconds left) of each string key under ``head``
    that still has a TTL: SCAN, not KEYS; keys released between SCAN and the read are
    skipped. What ``manage.py explicit_locks`` and ``explicit_leases`` list."""
    for raw_key in client.scan_iter(match=f"{head}*", count=500, _type="STRING"):
        key = text(raw_key)
        pipe = client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        value, ttl_ms = pipe.execute()
        if value is None or int(ttl_ms) < 0:
            continue
        yield untag(key[len(head) :]), text(value), int(ttl_ms)
