"""Cache reads that never go back to an older version, and never show an uncommitted write.

Two helpers over a django-redis cache, each reading in one round trip on a hit:

``VersionedCache`` for rows that carry a version (a ``version`` column bumped by each
write). The version is the source's, never invented by the cache; it is stored with the
value, and the cache moves to a new version only after the write that made it commits::

    profiles = VersionedCache("user_profile:{user_id}", source=load_profile)

    def load_profile(*, user_id: int) -> tuple[dict[str, str], int]:
        row = Profile.objects.get(user_id=user_id)
        return {"name": row.name}, row.version

    profile = profiles.get(user_id=42)              # one GET on a hit

    with transaction.atomic():
        row = Profile.objects.select_for_update().get(user_id=42)
        row.name, row.version = "Ada", row.version + 1
        row.save()
        profiles.bump(row.version, user_id=42)      # runs after COMMIT, never before

``CacheAside`` for values without a version: read through, and ``invalidate()`` after
commit. A reader that read the source before the commit cannot put its old value back
after the invalidation: it may only fill with a lease the invalidation deletes.

State in Redis, per entity, under the cache's ``KEY_PREFIX`` and ``VERSION``:

- versioned: ``<identity>``, the pair ``(version, value)`` (with ``timeout``), and
  ``<identity>:ver``, the newest version known (an integer, no TTL, so that a slow reader
  can never store an older version after it). A fill stores the pair only if its version
  is not older than ``:ver``; a bump moves ``:ver`` forward only and deletes the pair.
  So a pair in the cache always carries the newest version known, and a hit is a single
  GET: the same command, and nearly the same cost, as ``cache.get`` (bench P5). Naming
  value keys by version (``user_profile:42:v7``) would need the version before the value:
  a Lua script on every hit, measured at 0.8 of ``cache.get``.
- cache-aside: ``<identity>``, the value, and ``<identity>:lease``, the fill lease.

There is no wildcard invalidation: a bump or an invalidation names one entity.

Values go through the cache's own serializer and compressor (django-redis' ``encode`` /
``decode``; pickle unless ``OPTIONS["SERIALIZER"]`` says otherwise), so an operator's
``cache.get("user_profile:42")`` shows ``(7, {...})``.

Staleness: a reader cannot tell on a hit that the source moved on without asking the
source. It is seen where the source is read anyway: each fill after a miss compares the
cached version with the source's, and ``verify()`` (call it periodically, or from a
health check) does the same on demand and repairs a lost bump. Both count in
``stats()`` and in ``explicit_cache_stale_total``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import string
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, NoReturn, TypeVar
from uuid import UUID

import redis
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, transaction
from django_redis.client import ShardClient
from prometheus_client import Counter

from celery_explicit.errors import ExplicitError

__all__ = [
    "VersionedCache",
    "CacheAside",
    "CacheStats",
    "Verification",
    "CacheKeyError",
    "CacheConfigError",
]

logger = logging.getLogger("django_outbox.cache")

T = TypeVar("T")
#: What a key field may hold. Not bool or float (True, 1.0 and 1 are equal in Python but
#: would be three keys for one row), never None (every missing id would share one key).
FieldValue = int | str | UUID


# --- errors ----------------------------------------------------------------------------


class CacheKeyError(ExplicitError, ValueError):
    """The fields or version given to a cache do not fit its key template: fix the caller.

    Carries ``cache_name`` and ``field`` (``"version"`` for a bad version).
    """

    def __init__(self, cache_name: str, field: str | None, message: str) -> None:
        self.cache_name = cache_name
        self.field = field
        super().__init__(f"Cache {cache_name}: {message}")


class CacheConfigError(ExplicitError, ImproperlyConfigured):
    """A cache declared with a bad template or option, or over a backend that is not
    django-redis. Carries ``cache_name`` and ``field`` (the template field or option)."""

    def __init__(self, cache_name: str, field: str | None, message: str) -> None:
        self.cache_name = cache_name
        self.field = field
        super().__init__(f"Cache {cache_name}: {message}")


# --- metrics ---------------------------------------------------------------------------
# Declared here rather than in celery_explicit.metrics: the cache is a django_outbox
# feature, and a reader looking for its counters opens this file.

reads = Counter(
    "explicit_cache_reads_total",
    "Reads through django_outbox.cache, by outcome: hit (one round trip) or miss "
    "(the source was read).",
    ["cache", "outcome"],
)
fills = Counter(
    "explicit_cache_fills_total",
    "Values written after a miss: stored, or refused because the cache already held a "
    "newer version (versioned) or the fill lease was invalidated (cache-aside).",
    ["cache", "outcome"],
)
stale_seen = Counter(
    "explicit_cache_stale_total",
    "Times the cache held a version older than the source's, as seen by a fill after a "
    "miss or by verify(). Divide by explicit_cache_compared_total for a rate.",
    ["cache", "seen_by"],
)
compared = Counter(
    "explicit_cache_compared_total",
    "Times the cached version was compared with the source's (fills and verify()).",
    ["cache"],
)
invalidation_failures = Counter(
    "explicit_cache_invalidation_failures_total",
    "Bumps or invalidations that failed after their transaction committed: the cache may "
    "serve the previous value until its timeout, or until verify() repairs it.",
    ["cache"],
)


@dataclass(frozen=True)
class CacheStats:
    """What this process saw for one cache since it started (prefork: per child).

    ``stale / compared`` is how often the cache was found behind the source.
    """

    hits: int = 0
    misses: int = 0
    stored: int = 0
    refused: int = 0
    compared: int = 0
    stale: int = 0
    invalidation_failures: int = 0


class _Counts:
    """Thread-safe in-process counts, each mirrored to its Prometheus child."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(CacheStats.__dataclass_fields__, 0)
        # Children bound once: labels() takes a lock and a dict lookup on every call.
        self._children = {
            "hits": reads.labels(name, "hit"),
            "misses": reads.labels(name, "miss"),
            "stored": fills.labels(name, "stored"),
            "refused": fills.labels(name, "refused"),
            "compared": compared.labels(name),
            "invalidation_failures": invalidation_failures.labels(name),
        }
        self._stale = {
            "fill": stale_seen.labels(name, "fill"),
            "verify": stale_seen.labels(name, "verify"),
        }

    def add(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1
        self._children[what].inc()

    def stale(self, seen_by: str) -> None:
        with self._lock:
            self._counts["stale"] += 1
        self._stale[seen_by].inc()

    def snapshot(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._counts)


# --- key templates ---------------------------------------------------------------------


class _Template:
    """A parsed key template: the entity's name (up to the first ':') and its fields."""

    def __init__(self, template: str, *, versioned: bool) -> None:
        # The template names the entity; the helpers append ":ver" or ":lease" to it.
        name = template.split(":", 1)[0] if isinstance(template, str) else ""
        if not name or "{" in name or ":" not in template:
            raise CacheConfigError(
                str(template),
                None,
                f"key template {template!r} must start with a literal name and a colon, "
                "e.g. 'user_profile:{user_id}'",
            )
        self.name = name
        self.template = template
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:  # an unmatched brace
            raise CacheConfigError(name, None, f"key template {template!r}: {exc}") from exc
        fields: list[str] = []
        for _literal, field, spec, conversion in parsed:
            if field is None:
                continue
            if not field.isidentifier():
                raise CacheConfigError(
                    name,
                    field or None,
                    f"field {{{field}}} in {template!r} must be a plain name: no positional "
                    "fields, attributes or indexes (the caller passes each field by name)",
                )
            if spec or conversion:
                raise CacheConfigError(
                    name,
                    field,
                    f"field {{{field}}} in {template!r} has a format spec or conversion: "
                    "two spellings of one value would be two keys for one row",
                )
            if field == "using":
                raise CacheConfigError(
                    name, field, "'using' is reserved (the cache's database option)"
                )
            fields.append(field)
        if "version" in fields:
            hint = (
                "the version is stored with the value, not in the key (one GET per read)"
                if versioned
                else "use VersionedCache, which takes the version from the source"
            )
            raise CacheConfigError(
                name, "version", f"key template {template!r} has a {{version}} field: {hint}"
            )
        self.fields = frozenset(fields)

    def render(self, given: Mapping[str, object]) -> str:
        """The entity's key (before the cache's prefix); ``CacheKeyError`` naming the field
        that does not fit."""
        if given.keys() != self.fields:
            self._mismatch(given)
        for field, value in given.items():
            if type(value) is int or isinstance(value, UUID):
                continue
            if isinstance(value, str) and value and ":" not in value:
                continue
            self._bad_value(field, value)
        return self.template.format_map(given)

    def check_version(self, version: object, origin: str) -> int:
        if type(version) is not int or version < 0:
            raise CacheKeyError(
                self.name,
                "version",
                f"version {origin} must be a non-negative integer, got {version!r}",
            )
        return version

    def _mismatch(self, given: Mapping[str, object]) -> NoReturn:
        if "version" in given:
            raise CacheKeyError(
                self.name,
                "version",
                "the version is not a key field: reads take it from the cache or the "
                "source, bump() takes it as its first argument",
            )
        missing = sorted(self.fields - given.keys())
        if missing:
            raise CacheKeyError(
                self.name, missing[0], f"field {missing[0]!r} is missing (key {self.template!r})"
            )
        unknown = sorted(given.keys() - self.fields)[0]
        raise CacheKeyError(
            self.name,
            unknown,
            f"field {unknown!r} is not in the key {self.template!r} "
            f"(its fields: {', '.join(sorted(self.fields)) or 'none'})",
        )

    def _bad_value(self, field: str, value: object) -> NoReturn:
        if value is None:
            problem = "is None"
        elif isinstance(value, str):
            # "a:{x}:{y}" with x="1:2", y="3" and x="1", y="2:3" would be one key.
            problem = "is empty" if not value else f"contains ':' ({value!r})"
        else:
            problem = f"is a {type(value).__name__} ({value!r}), not an int, str or UUID"
        raise CacheKeyError(self.name, field, f"field {field!r} {problem} (key {self.template!r})")


def _seconds(name: str, option: str, value: object) -> int:
    """A positive, finite duration in seconds, as the milliseconds Redis takes."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CacheConfigError(
            name, option, f"{option}={value!r} must be a positive, finite number of seconds"
        )
    return max(1, int(value * 1000))


# --- Redis -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Script:
    """A Lua script run on whichever client the cache resolves at the call (redis-py's
    ``register_script`` binds one client)."""

    source: str
    sha: str


def _script(source: str) -> _Script:
    return _Script(source, hashlib.sha1(source.encode()).hexdigest())


def _run(client: Any, script: _Script, keys: list[str], args: list[Any]) -> Any:
    """EVALSHA: one round trip. A Redis that lost its script cache (restart, SCRIPT FLUSH)
    answers NOSCRIPT once; EVAL then sends the body, and caches it again."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return client.eval(script.source, len(keys), *keys, *args)


# Versions are compared as decimal strings (shorter is older, then byte order): exact for
# any size, where Lua's tonumber() rounds above 2^53. Python writes them canonically.
_OLDER = """
local function older(a, b)
    return #a < #b or (#a == #b and a < b)
end
"""

# KEYS[1] - the pair: the cache's encoding of (version, value)
# KEYS[2] - the version key (<identity>:ver)
# ARGV[1] - the version the source returned (decimal)
# ARGV[2] - the pair, encoded by the cache's serializer
# ARGV[3] - the pair's ttl in milliseconds
# return {1 if stored else 0, the version held before (false if none)}: stored, and the
#   version key set to ARGV[1], only if that version was not newer
_FILL = _script(
    _OLDER
    + """
local current = redis.call('get', KEYS[2])
if current and older(ARGV[1], current) then
    return {0, current}
end
redis.call('set', KEYS[2], ARGV[1])
redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, current}
"""
)

# KEYS[1] - the pair
# KEYS[2] - the version key
# ARGV[1] - the committed version
# return the version held before (false if none); if that was older, or none, the
#   version key now holds ARGV[1] and the pair, of an older version, is deleted
_BUMP = _script(
    _OLDER
    + """
local current = redis.call('get', KEYS[2])
if current and not older(current, ARGV[1]) then
    return current
end
redis.call('set', KEYS[2], ARGV[1])
redis.call('del', KEYS[1])
return current
"""
)

# KEYS[1] - the value
# KEYS[2] - the fill lease
# ARGV[1] - a new lease token
# ARGV[2] - lease ttl in milliseconds
# return {value, 0} if it is cached by now, {false, 1} when this reader got the lease,
#   {false, 0} when another reader holds it (read the source, do not fill)
_READ_OR_LEASE = _script("""
local value = redis.call('get', KEYS[1])
if value then
    return {value, 0}
end
if redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return {false, 1}
end
return {false, 0}
""")

# KEYS[1] - the value
# KEYS[2] - the fill lease
# ARGV[1] - the lease token this reader got
# ARGV[2] - the value, encoded by the cache's serializer
# ARGV[3] - the value's ttl in milliseconds
# return 1 if stored (the lease was still this reader's), otherwise 0
_FILL_WITH_LEASE = _script("""
if redis.call('get', KEYS[2]) ~= ARGV[1] then
    return 0
end
redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('del', KEYS[2])
return 1
""")


_SUPPORTED: set[type] = set()


def _cache_client(alias: str, name: str) -> Any:
    """The django-redis client (``caches[alias].client``), resolved per call so that
    ``override_settings(CACHES=...)`` and per-thread cache instances work."""
    client = getattr(caches[alias], "client", None)
    if type(client) not in _SUPPORTED:  # checked once per client class: this is every read
        if not hasattr(client, "get_client") or isinstance(client, ShardClient):
            raise CacheConfigError(
                name,
                "cache",
                f"cache alias {alias!r} is not a django-redis cache with DefaultClient: an "
                "entity's keys must be changed together by one script on one Redis",
            )
        _SUPPORTED.add(type(client))
    return client


def _base_key(client: Any, name: str, identity: str) -> str:
    base: str = client.make_key(identity)  # a CacheKey: a str
    # ":ver" and ":lease" are appended to the made key; a KEY_FUNCTION that hashes or
    # reorders the key would put them somewhere else.
    if not base.endswith(identity):
        raise CacheConfigError(
            name, "cache", "the cache's KEY_FUNCTION must end the Redis key with the key given"
        )
    return base


# --- the helpers -----------------------------------------------------------------------


@dataclass(frozen=True)
class Verification:
    """What ``verify()`` found: the cached version (None: not cached) and the source's."""

    cached: int | None
    source: int
    stale: bool


class VersionedCache(Generic[T]):
    """Values cached with their version, which comes from a trusted source.

    ``key`` names the entity (``"user_profile:{user_id}"``). ``source(**fields)`` returns
    ``(value, version)`` read from the database ``using``; ``version`` is a non-negative
    integer that grows with each committed write. ``timeout`` (seconds) bounds a value's
    life, hence how long a lost bump can serve an older value. Declare it once, at module
    level: nothing is read until the first call.
    """

    def __init__(
        self,
        key: str,
        *,
        source: Callable[..., tuple[T, int]],
        timeout: float = 300.0,
        cache: str = "default",
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self._template = _Template(key, versioned=True)
        self.name = self._template.name
        self._source = source
        self._ttl_ms = _seconds(self.name, "timeout", timeout)
        self._cache = cache
        self._using = using
        self._counts = _Counts(self.name)

    def get(self, **fields: FieldValue) -> T:
        """The value at the newest version cached: one GET on a hit, else the source."""
        return self._read(fields)[0]

    def get_versioned(self, **fields: FieldValue) -> tuple[T, int]:
        """``(value, version)``; on a miss the source's, stored for that version after commit."""
        return self._read(fields)

    def bump(self, version: int, /, **fields: FieldValue) -> None:
        """After the transaction on ``using`` commits, move the cache to ``version``.

        Never back: a bump not newer than the cached version does nothing. Outside a
        transaction it applies at once; after a rollback, never. Bad fields or version
        raise here, inside the transaction, not at commit.
        """
        version = self._template.check_version(version, "given to bump()")
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        key = _base_key(client, self.name, identity)
        transaction.on_commit(partial(self._bump, client, key, version), using=self._using)

    def verify(self, **fields: FieldValue) -> Verification:
        """Compare the cached version with the source's; count and repair a stale one.

        Reads the source first: a cached version older than a version already committed
        is stale at that instant, never a false alarm from a write committing in between.
        Call it outside a transaction (the source must read committed rows).
        """
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        key = _base_key(client, self.name, identity)
        _, version = self._load(fields)
        raw = client.get_client(True).get(key + ":ver")
        cached = None if raw is None else int(raw)
        self._counts.add("compared")
        stale = cached is not None and cached < version
        if stale:
            self._counts.stale("verify")
            logger.warning(
                "cache %s: %s cached at version %s, source at %s: repairing",
                self.name,
                identity,
                cached,
                version,
                extra={"cache": self.name, "identity": identity},
            )
            transaction.on_commit(partial(self._bump, client, key, version), using=self._using)
        return Verification(cached=cached, source=version, stale=stale)

    def stats(self) -> CacheStats:
        """This process's counts for this cache."""
        return self._counts.snapshot()

    def _read(self, fields: Mapping[str, FieldValue]) -> tuple[T, int]:
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        key = _base_key(client, self.name, identity)
        # The primary (write=True), even for a read: a replica may not have the last bump.
        raw = client.get_client(True).get(key)
        if raw is not None:
            self._counts.add("hits")
            version, value = client.decode(raw)
            return value, version
        self._counts.add("misses")
        value, version = self._load(fields)
        # In a transaction the source may have read this transaction's own write: storing
        # it now would show it before COMMIT, and keep it after a ROLLBACK. Outside one,
        # on_commit runs the fill at once.
        encoded = client.encode((version, value))
        transaction.on_commit(partial(self._fill, client, key, version, encoded), using=self._using)
        return value, version

    def _load(self, fields: Mapping[str, FieldValue]) -> tuple[T, int]:
        result = self._source(**fields)
        if not isinstance(result, tuple) or len(result) != 2:
            raise CacheKeyError(
                self.name, "version", f"the source must return (value, version), got {result!r}"
            )
        value, version = result
        return value, self._template.check_version(version, "returned by the source")

    def _fill(self, client: Any, key: str, version: int, encoded: Any) -> None:
        try:
            stored, previous = _run(
                client.get_client(True),
                _FILL,
                [key, key + ":ver"],
                [version, encoded, self._ttl_ms],
            )
        except redis.RedisError:
            # The reader already has its value; the next one misses and tries again.
            logger.warning("cache %s: fill of %s failed", self.name, key, exc_info=True)
            return
        self._counts.add("stored" if stored else "refused")
        self._counts.add("compared")
        if previous is not None and int(previous) < version:
            # A version older than one already committed was cached: the bump after that
            # commit has not run yet, or was lost.
            self._counts.stale("fill")

    def _bump(self, client: Any, key: str, version: int) -> None:
        try:
            _run(client.get_client(True), _BUMP, [key, key + ":ver"], [version])
        except redis.RedisError:
            # The transaction has committed: raising would report a failure for a write
            # that happened. The previous value stays until its timeout or verify().
            self._counts.add("invalidation_failures")
            logger.error(
                "cache %s: bump of %s to version %s failed after commit",
                self.name,
                key,
                version,
                exc_info=True,
                extra={"cache": self.name},
            )


class CacheAside(Generic[T]):
    """A value read through from ``source(**fields)`` and invalidated after commit.

    For values without a version. A miss takes a fill lease (``lease`` seconds) before
    reading the source; ``invalidate()`` deletes the value and the lease together, so a
    reader that read the source before the write committed cannot store its old value
    afterwards. Only one reader fills at a time; the others read the source meanwhile.
    """

    def __init__(
        self,
        key: str,
        *,
        source: Callable[..., T],
        timeout: float = 300.0,
        lease: float = 10.0,
        cache: str = "default",
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self._template = _Template(key, versioned=False)
        self.name = self._template.name
        self._source = source
        self._ttl_ms = _seconds(self.name, "timeout", timeout)
        self._lease_ms = _seconds(self.name, "lease", lease)
        self._cache = cache
        self._using = using
        self._counts = _Counts(self.name)

    def get(self, **fields: FieldValue) -> T:
        """The cached value (one GET), else the source's."""
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        key = _base_key(client, self.name, identity)
        redis_client = client.get_client(True)
        raw = redis_client.get(key)
        if raw is None:
            # A miss costs a second round trip, for the lease: hits stay a plain GET.
            keys, token = [key, key + ":lease"], os.urandom(8).hex()
            raw, leased = _run(redis_client, _READ_OR_LEASE, keys, [token, self._lease_ms])
            if raw is None:
                self._counts.add("misses")
                value = self._source(**fields)
                if leased:
                    # After commit, as for VersionedCache: never store what this
                    # transaction wrote but has not committed.
                    encoded = client.encode(value)
                    transaction.on_commit(
                        partial(self._fill, client, keys, token, encoded), using=self._using
                    )
                return value
        self._counts.add("hits")
        cached: T = client.decode(raw)
        return cached

    def invalidate(self, **fields: FieldValue) -> None:
        """After the transaction on ``using`` commits, delete the value and its fill lease.

        One key, named by its fields: there is no wildcard invalidation.
        """
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        base = _base_key(client, self.name, identity)
        transaction.on_commit(partial(self._delete, client, base), using=self._using)

    def stats(self) -> CacheStats:
        """This process's counts for this cache."""
        return self._counts.snapshot()

    def _fill(self, client: Any, keys: list[str], token: str, encoded: Any) -> None:
        try:
            stored = _run(
                client.get_client(True), _FILL_WITH_LEASE, keys, [token, encoded, self._ttl_ms]
            )
        except redis.RedisError:
            logger.warning("cache %s: fill of %s failed", self.name, keys[0], exc_info=True)
            return
        self._counts.add("stored" if stored else "refused")

    def _delete(self, client: Any, base: str) -> None:
        try:
            # One DEL of both keys: atomic, nothing to compare.
            client.get_client(True).delete(base, base + ":lease")
        except redis.RedisError:
            self._counts.add("invalidation_failures")
            logger.error(
                "cache %s: invalidation of %s failed after commit",
                self.name,
                base,
                exc_info=True,
                extra={"cache": self.name},
            )
