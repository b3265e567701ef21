"""Our Lua as Redis functions (``FUNCTION LOAD``, ``FCALL``), with scripts as the fallback.

The lease lock's compare-and-act steps must each be one atomic step on the server, so
they are Lua. Redis 7 runs Lua two ways: a script sent by its SHA1 (``EVALSHA``) or a
function loaded once into a library (``FCALL``). On the development machine an
``FCALL`` cost about what the plain command costs, and an ``EVALSHA`` of the same Lua
about 4 us more, which was most of what kept the lock under its benchmark targets
(docs/performance.md, P4).

A library is loaded on its first call through each client, under a name that carries
a hash of its code, so two versions of this package can share a Redis. Where the
server has no functions (Redis 6) or the client's user may not load them (an ACL
without ``FUNCTION``), the same Lua runs as scripts. A library that disappeared
(``FUNCTION FLUSH``, a replica promoted before it got it) is loaded again on the call
that found it missing.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from celery_explicit import redis_state

logger = logging.getLogger("celery_explicit.redis_functions")

#: Replies that say the server has no functions (Redis 6): keep to scripts. A user
#: without the permission gets NoPermissionError, which is kept to scripts as well.
_NO_FUNCTIONS = ("unknown command", "unknown subcommand")


class Library:
    """Named Lua bodies (using ``KEYS`` and ``ARGV`` as scripts do), called by name."""

    def __init__(self, name: str, functions: Mapping[str, str]) -> None:
        digest = hashlib.sha1(
            "\0".join(f"{fn}\0{body}" for fn, body in sorted(functions.items())).encode()
        ).hexdigest()[:12]
        self.name = f"{name}_{digest}"
        self.functions = dict(functions)
        # Function names are global on the server: the library's name goes first.
        self.function_names = {fn: f"{self.name}_{fn}" for fn in functions}
        registrations = "\n".join(
            f"redis.register_function('{self.function_names[fn]}', "
            f"function(KEYS, ARGV)\n{body}\nend)"
            for fn, body in self.functions.items()
        )
        self.code = f"#!lua name={self.name}\n{registrations}\n"
        # Per client, weakly (a caller's client must not be kept alive by us): True once
        # the library is loaded there, False where scripts stand in for it.
        self._clients: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def call(self, conn: Any, function: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run ``function`` atomically on the server; its reply."""
        try:
            loaded = self._clients[conn]
        except KeyError:
            loaded = self._load(conn)
        if not loaded:
            return redis_state.script(conn, self.functions[function])(keys=keys, args=args)
        name = self.function_names[function]
        try:
            return conn.execute_command("FCALL", name, len(keys), *keys, *args)
        except ResponseError as exc:
            if "function not found" not in str(exc).lower():
                raise
        self._load(conn)
        return conn.execute_command("FCALL", name, len(keys), *keys, *args)

    def _load(self, conn: Any) -> bool:
        """Load the library through ``conn``; False when scripts must stand in for it."""
        loaded = True
        try:
            conn.execute_command("FUNCTION", "LOAD", "REPLACE", self.code)
        except ResponseError as exc:
            refused = isinstance(exc, NoPermissionError) or any(
                reason in str(exc).lower() for reason in _NO_FUNCTIONS
            )
            if not refused:
                raise
            logger.info(
                "Redis functions unavailable (%s): library %s runs as scripts", exc, self.name
            )
            loaded = False
        with self._lock:
            self._clients[conn] = loaded
        return loaded
