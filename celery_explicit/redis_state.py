"""Where the contracts keep their state in Redis: one key prefix, one client per process.

Dedup marks, delivery counts and downstream limits live in the Redis named by
``EXPLICIT_REDIS_URL`` (by default the broker, when it is Redis). Locks and leases take
their client from the caller (locks) or the broker connection (leases) but share the
prefix, so an operator finds everything under ``explicit:``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
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
            # Timeouts: the worker's main loop extends leases with this client, and
            # a Redis that stops answering must not stall it.
            _clients[url] = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        return _clients[url]


def text(value: Any) -> str:
    """A Redis reply (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


# Per client, weakly: a caller's client (a lock's, a test's) is not kept alive by us.
_scripts: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def script(conn: Any, source: str) -> Any:
    """``conn.register_script(source)``, made once per client and script.

    Registering hashes the source (SHA1) and builds an object; on the job path that
    happens for every task, so it is kept.
    """
    try:
        return _scripts[conn][source]
    except KeyError:
        registered = conn.register_script(source)
        with _clients_lock:
            _scripts.setdefault(conn, {})[source] = registered
        return registered


def run_pipelined(conn: Any, source: str, calls: Sequence[Sequence[Any]]) -> list[Any]:
    """The script ``source`` once per ``keys + args`` list in ``calls``, in one round trip.

    By its hash (``EVALSHA``) in a plain pipeline: a pipeline handed a redis-py Script
    object first asks the server ``SCRIPT EXISTS``, a second round trip every time.
    Where the server does not have the script yet, it is loaded and the pipeline sent
    again. Each entry of ``calls`` is ``(number of keys, *keys, *args)``.
    """
    import redis

    sha = script(conn, source).sha
    for attempt in range(2):
        pipe = conn.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(sha, *call)
        replies = pipe.execute(raise_on_error=False)
        if attempt or not any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            break
        conn.script_load(source)
    errors = [r for r in replies if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    return list(replies)


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
        yield key[len(head) :], text(value), int(ttl_ms)
