"""Every Lua script we run on Redis: registered by name, called one way.

Each compare-and-act step on Redis (take a lease, claim a dedup id, pass an entity's
turn, enter a downstream) is one Lua script, so it is atomic on the server. Each
module keeps its scripts as ``Script`` constants headed by their contract (``KEYS``,
``ARGV``, what they return), and calls them through ``call`` or, several in one round
trip, ``call_many``. This module decides how they run:

- as **functions** (``FCALL``) of one library holding every registered script, where
  the server has them (Redis 7+): loaded by the first call through each client, under
  a name carrying a hash of the code (two versions of this package can share a Redis),
  and loaded again by the call that finds it missing (``FUNCTION FLUSH``, a replica
  promoted before it got it). An ``FCALL`` costs about what the plain command costs,
  an ``EVALSHA`` of the same Lua a few microseconds more (docs/performance.md);
- as **scripts** (``EVALSHA``, loaded on ``NOSCRIPT``) where the server has no
  functions (Redis 6) or the client's user may not load them (an ACL without
  ``FUNCTION``).

Both are sent with ``execute_command``: one round trip on the common path, never the
``SCRIPT EXISTS`` that redis-py's ``Script`` object adds in a pipeline.

Libraries of old versions are removed. Functions are global on a server and every
version loads its own library, so a deploy a day would leave hundreds. Each process that
loads its library registers it in the sorted set ``{prefix}libraries`` (member: the
library's name, score: the server's clock), again at most every ``LIBRARY_HEARTBEAT``
seconds from the worker's heartbeat (``call_many``); then it deletes every library of
that set not registered for ``LIBRARY_HORIZON`` seconds, its own excepted. Replacing
one fixed library in place instead would be wrong during a rolling deploy: the old
workers would then call the new version's code, or fail on a function it renamed. A
library deleted while a process of its version still runs (one that made no call for
the horizon) costs that process one load: its next call finds the function missing and
loads it again, as after a ``FUNCTION FLUSH``. Only libraries registered in the same
set are removed, never one of another prefix or database; libraries loaded by versions
from before the register are not in it (docs/howto/small-state.md removes them).

Redis Cluster: every key a script touches is passed in ``KEYS``, and the keys of one
call share a hash tag (``tagged``), so each call lands on one slot.
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from celery_explicit import job_log, redis_state
from celery_explicit.redis_state import text

logger = job_log.get_logger("celery_explicit.redis_scripts")

#: Replies that say the server has no functions (Redis 6): keep to scripts. A user
#: without the permission gets NoPermissionError, which is kept to scripts as well.
_NO_FUNCTIONS = ("unknown command", "unknown subcommand")
_LIBRARY_PREFIX = "celery_explicit"
#: Seconds between two registrations of a worker's library (its heartbeat).
LIBRARY_HEARTBEAT = 600.0
#: Seconds after its last registration a library is removed: no process of its version
#: has registered it for this long (a day: many heartbeats, and a deploy's overlap).
LIBRARY_HORIZON = 24 * 3600.0


#: Lua that sets ``now_ms``: the server's clock, in milliseconds. A script that compares
#: a time with one another host wrote (an ordering gap, a breaker's cool-down, a
#: message's lease) reads this clock on both sides: two hosts' clocks may disagree by
#: more than the interval compared, one server's cannot.
SERVER_NOW_MS = """local server_time = redis.call('time')
local now_ms = tonumber(server_time[1]) * 1000 + math.floor(tonumber(server_time[2]) / 1000)
"""


def server_time(conn: Any) -> float:
    """The Redis server's clock (seconds): what our scripts' times are written in."""
    seconds, micros = conn.time()
    return float(seconds) + float(micros) / 1e6


class Script:
    """One Lua script (using ``KEYS`` and ``ARGV``), registered under ``name``."""

    def __init__(self, name: str, source: str) -> None:
        if not name.isidentifier():
            raise ValueError(f"script name {name!r} must be an identifier (a function name)")
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        with _lock:
            known = _registry.get(name)
            if known is not None and known.source != source:
                raise ValueError(f"two different scripts are registered as {name!r}")
            _registry[name] = self
            global _library
            _library = None  # rebuilt with this script on the next call

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


@dataclass(frozen=True)
class Library:
    """Every registered script as one function library."""

    name: str
    code: str
    function_names: dict[str, str]


_lock = threading.Lock()
_registry: dict[str, Script] = {}
_library: Library | None = None
# Per client, by id and weakly (a caller's client must not be kept alive by us): a
# reference to it and the name of the library loaded there, or False where scripts
# stand in for functions. Keyed by id, not a WeakKeyDictionary: its look-up is a Python
# call and a new reference, about 700 CPU instructions a call (callgrind, on a lock
# cycle against a stubbed client: about 5% of the cycle's instructions).
_clients: dict[int, tuple[weakref.ref[Any], str | bool]] = {}


def _loaded(conn: Any) -> str | bool | None:
    """What was loaded through ``conn``: a library's name, False, or None (not seen)."""
    seen = _clients.get(id(conn))
    if seen is None or seen[0]() is not conn:  # another client's old id
        return None
    return seen[1]


def _remember(conn: Any, loaded: str | bool) -> None:
    key = id(conn)

    def forget(ref: weakref.ref[Any]) -> None:
        # No lock: a callback can run while this thread holds it (a collection inside
        # library()). Racing a new client given the same id, this may drop its entry:
        # that client is then only probed again.
        seen = _clients.get(key)
        if seen is not None and seen[0]() is None:
            _clients.pop(key, None)

    with _lock:
        _clients[key] = (weakref.ref(conn, forget), loaded)


def library() -> Library:
    """The library of every script registered so far."""
    global _library
    with _lock:
        if _library is None:
            scripts = sorted(_registry.values(), key=lambda s: s.name)
            digest = hashlib.sha1(
                "\0".join(f"{s.name}\0{s.source}" for s in scripts).encode()
            ).hexdigest()[:12]
            name = f"{_LIBRARY_PREFIX}_{digest}"
            # Function names are global on the server: the library's name goes first.
            names = {s.name: f"{name}_{s.name}" for s in scripts}
            body = "\n".join(
                f"redis.register_function('{names[s.name]}', function(KEYS, ARGV)\n{s.source}\nend)"
                for s in scripts
            )
            _library = Library(name=name, code=f"#!lua name={name}\n{body}\n", function_names=names)
        return _library


# Claims that go to the first to ask: a dedup id at publish (``dedup``), a periodic
# entry's schedule slot at a beat (``periodic``).
# KEYS[1] - the claim   ARGV[1] - the claimant   ARGV[2] - how long it is kept, in ms
# return the claimant that holds it: ARGV[1] if this call claimed it, else the holder
CLAIM_IF_FREE = Script(
    "claim_if_free",
    """
local holder = redis.call('get', KEYS[1])
if holder then
    return holder
end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
""",
)

# KEYS[1] - the claim   ARGV[1] - the claimant that took it
# return 1 if this claimant's claim was removed, otherwise 0 (another's stays)
RELEASE_IF_MINE = Script(
    "release_if_mine",
    """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
""",
)


def tagged(value: str) -> str:
    """``{value}``: a Redis Cluster hash tag; keys carrying the same one share a slot."""
    return "{" + value + "}"


def call(conn: Any, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """Run ``script`` atomically on the server; its reply."""
    # Every lease, lock, dedup and ordering step comes through here, a few times a job:
    # the built library is read without taking the registry's lock (a script registered
    # meanwhile only resets it to None), and a client seen before costs one look-up
    # (``_loaded``, written out here: a call more would be most of what it saves).
    lib = _library or library()
    seen = _clients.get(id(conn))
    if (seen is not None and seen[1] == lib.name and seen[0]() is conn) or _uses_functions(
        conn, lib
    ):
        command = ("FCALL", lib.function_names[script.name], len(keys), *keys, *args)
        try:
            return conn.execute_command(*command)
        except ResponseError as exc:
            if not _missing_function(exc):
                raise
        _load(conn, lib)
        return conn.execute_command(*command)
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    try:
        return conn.execute_command(*command)
    except NoScriptError:
        conn.execute_command("SCRIPT", "LOAD", script.source)
    return conn.execute_command(*command)


def prepared(conn: Any, script: Script, *, reload: bool = False) -> tuple[str, str]:
    """The head of the command that runs ``script`` (``("FCALL", name)`` or
    ``("EVALSHA", sha)``), its code loaded on the server through ``conn``: for a caller
    that sends the command itself and reads the reply later, on a connection of its own
    (a consumer's poller). A reply that ``missing`` recognises asks for it again, with
    ``reload``."""
    lib = _library or library()
    if _load(conn, lib) if reload and _loaded(conn) is not False else _uses_functions(conn, lib):
        return ("FCALL", lib.function_names[script.name])
    conn.execute_command("SCRIPT", "LOAD", script.source)
    return ("EVALSHA", script.sha)


def missing(exc: BaseException) -> bool:
    """True when ``exc`` says the server lacks the function or script called (restarted
    without persistence, ``FUNCTION FLUSH``, a failover)."""
    return isinstance(exc, NoScriptError) or (
        isinstance(exc, ResponseError) and _missing_function(exc)
    )


def call_many(conn: Any, calls: Sequence[tuple[Script, Sequence[Any], Sequence[Any]]]) -> list[Any]:
    """Each ``(script, keys, args)`` of ``calls``, in one pipeline: one round trip.

    What the server is missing (the library, a script) is loaded and the pipeline sent
    again; the first error among the replies is raised.
    """
    lib = library()
    functions = _uses_functions(conn, lib)
    if functions:
        # The worker's heartbeat comes through here: it keeps its library registered.
        _heartbeat(conn, lib)
    replies: list[Any] = []
    for attempt in range(2):
        pipe = conn.pipeline(transaction=False)
        for script, keys, args in calls:
            if functions:
                pipe.execute_command(
                    "FCALL", lib.function_names[script.name], len(keys), *keys, *args
                )
            else:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        missing = any(
            isinstance(r, NoScriptError) or (isinstance(r, ResponseError) and _missing_function(r))
            for r in replies
        )
        if attempt or not missing:
            break
        if functions:
            _load(conn, lib)
        else:
            for source in {script.source for script, _keys, _args in calls}:
                conn.execute_command("SCRIPT", "LOAD", source)
    errors = [r for r in replies if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    return list(replies)


def _uses_functions(conn: Any, lib: Library) -> bool:
    loaded = _loaded(conn)
    if loaded is False:
        return False
    if loaded != lib.name:
        return _load(conn, lib)
    return True


def _missing_function(exc: ResponseError) -> bool:
    return "function not found" in str(exc).lower()


def _load(conn: Any, lib: Library) -> bool:
    """Load the library through ``conn``; False when scripts must stand in for it.
    Loaded, it is registered, and the libraries no process registered for the horizon
    are removed."""
    loaded: str | bool = lib.name
    try:
        conn.execute_command("FUNCTION", "LOAD", "REPLACE", lib.code)
    except ResponseError as exc:
        refused = isinstance(exc, NoPermissionError) or any(
            reason in str(exc).lower() for reason in _NO_FUNCTIONS
        )
        if not refused:
            raise
        logger.info("Redis functions unavailable (%s): our Lua runs as scripts", exc)
        loaded = False
    _remember(conn, loaded)
    if loaded is not False:
        remove_stale_libraries(conn, keep=lib.name)
    return loaded is not False


def libraries_key() -> str:
    """The sorted set of our libraries, scored by when a process last registered each."""
    return f"{redis_state.prefix()}libraries"


# Per client (by id, as ``_clients``): when this process last registered its library
# there (monotonic seconds).
_registered: dict[int, float] = {}


def _heartbeat(conn: Any, lib: Library) -> None:
    """Register ``lib`` again if this process has not for ``LIBRARY_HEARTBEAT``."""
    last = _registered.get(id(conn))
    if last is None or time.monotonic() - last >= LIBRARY_HEARTBEAT:
        register(conn, lib.name)


def register(conn: Any, name: str) -> list[tuple[str, float]]:
    """Record, on the server's clock, that a process of library ``name``'s version
    runs; every library of the set with the seconds since its registration.

    A user that may not write the set (an ACL) only loses the clean-up: logged."""
    now = server_time(conn)
    _registered[id(conn)] = time.monotonic()
    pipe = conn.pipeline(transaction=False)
    pipe.zadd(libraries_key(), {name: now})
    pipe.zrangebyscore(libraries_key(), "-inf", now, withscores=True)
    try:
        _added, found = pipe.execute()
    except ResponseError as exc:
        logger.warning("could not register Redis function library %s: %s", name, exc)
        return []
    return [(text(other), now - float(score)) for other, score in found]


def remove_stale_libraries(conn: Any, *, keep: str, horizon: float = LIBRARY_HORIZON) -> list[str]:
    """Register ``keep``, then delete the libraries of ``libraries_key()`` not
    registered for ``horizon`` seconds; the names removed.

    A library registered again between the read and its deletion is deleted anyway:
    its processes load it again at their next call (the function is missing)."""
    removed: list[str] = []
    for name, idle in register(conn, keep):
        if idle < horizon or name == keep or not name.startswith(f"{_LIBRARY_PREFIX}_"):
            continue
        try:
            conn.execute_command("FUNCTION", "DELETE", name)
        except NoPermissionError as exc:
            logger.warning("could not remove Redis function library %s: %s", name, exc)
            return removed
        except ResponseError as exc:
            if "not found" not in str(exc).lower():
                raise
        conn.zrem(libraries_key(), name)
        removed.append(name)
        logger.info("removed Redis function library %s: not registered for %.0fs", name, idle)
    return removed
