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
after the invalidation: it may only fill with a fill claim the invalidation deletes.

State in Redis, per entity, under the cache's ``KEY_PREFIX`` and ``VERSION``:

- versioned: ``<identity>``, the pair ``(version, value)`` (with ``timeout``), and
  ``<identity>:ver``, the newest version known (an integer, no TTL, so that a slow reader
  can never store an older version after it). A fill stores the pair only if its version
  is not older than ``:ver``; a bump moves ``:ver`` forward only and deletes the pair.
  So a pair in the cache always carries the newest version known, and a hit is a single
  GET: the same command, and nearly the same cost, as ``cache.get`` (bench P5). Naming
  value keys by version (``user_profile:42:v7``) would need the version before the value:
  a Lua script on every hit, measured at 0.8 of ``cache.get``.
- cache-aside: ``<identity>``, the value, and ``<identity>:lease``, the fill claim (the
  key keeps its first name, so processes before and after an upgrade share it; the
  ``lease`` option is its ttl).

There is no wildcard invalidation: a bump or an invalidation names one entity.

Values go through the cache's own serializer and compressor (django-redis' ``encode`` /
``decode``; pickle unless ``OPTIONS["SERIALIZER"]`` says otherwise), so an operator's
``cache.get("user_profile:42")`` shows ``(7, {...})``.

Staleness: a reader cannot tell on a hit that the source moved on without asking the
source. It is seen where the source is read anyway: each fill after a miss compares the
cached version with the source's, and ``verify()`` (call it periodically, or from a
health check) does the same on demand and repairs a lost bump. Both count in
``stats()`` and in ``explicit_cache_stale_total``.

This module holds the two helpers; their key templates are in ``cache_keys``, their
Lua scripts (each with its KEYS/ARGV contract) in ``cache_scripts``, their counters in
``cache_stats`` and their errors in ``django_outbox.errors``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import redis
from django.core.cache import caches
from django.db import DEFAULT_DB_ALIAS, transaction
from django_redis.client import ShardClient

from celery_explicit import job_log
from django_outbox.cache.keys import FieldValue, KeyTemplate, base_key
from django_outbox.cache.scripts import BUMP, FILL, FILL_WITH_CLAIM, READ_OR_CLAIM, run_script
from django_outbox.cache.stats import CacheStats, Counts

# The errors live under the app's exception root (django_outbox.errors); imported here
# too, where the code that raises them is, so ``from django_outbox.cache.versioned import
# CacheKeyError`` keeps working.
from django_outbox.errors import CacheConfigError, CacheKeyError

__all__ = [
    "VersionedCache",
    "CacheAside",
    "CacheStats",
    "Verification",
    "CacheKeyError",
    "CacheConfigError",
]

logger = job_log.get_logger("django_outbox.cache.versioned")

T = TypeVar("T")


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
        self._template = KeyTemplate(key, versioned=True)
        self.name = self._template.name
        self._source = source
        self._ttl_ms = _seconds(self.name, "timeout", timeout)
        self._cache = cache
        self._using = using
        self._counts = Counts(self.name)

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
        key = base_key(client, self.name, identity)
        transaction.on_commit(partial(self._bump, client, key, version), using=self._using)

    def verify(self, **fields: FieldValue) -> Verification:
        """Compare the cached version with the source's; count and repair a stale one.

        Reads the source first: a cached version older than a version already committed
        is stale at that instant, never a false alarm from a write committing in between.
        Call it outside a transaction (the source must read committed rows).
        """
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        key = base_key(client, self.name, identity)
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
        key = base_key(client, self.name, identity)
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
            stored, previous = run_script(
                client.get_client(True),
                FILL,
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
            run_script(client.get_client(True), BUMP, [key, key + ":ver"], [version])
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

    For values without a version. A miss takes a fill claim (held ``lease`` seconds)
    before reading the source; ``invalidate()`` deletes the value and the claim together, so a
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
        self._template = KeyTemplate(key, versioned=False)
        self.name = self._template.name
        self._source = source
        self._ttl_ms = _seconds(self.name, "timeout", timeout)
        self._claim_ms = _seconds(self.name, "lease", lease)
        self._cache = cache
        self._using = using
        self._counts = Counts(self.name)

    def get(self, **fields: FieldValue) -> T:
        """The cached value (one GET), else the source's."""
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        key = base_key(client, self.name, identity)
        redis_client = client.get_client(True)
        raw = redis_client.get(key)
        if raw is None:
            # A miss costs a second round trip, for the claim: hits stay a plain GET.
            keys, token = [key, key + ":lease"], os.urandom(8).hex()
            raw, claimed = run_script(redis_client, READ_OR_CLAIM, keys, [token, self._claim_ms])
            if raw is None:
                self._counts.add("misses")
                value = self._source(**fields)
                if claimed:
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
        """After the transaction on ``using`` commits, delete the value and its fill claim.

        One key, named by its fields: there is no wildcard invalidation.
        """
        identity = self._template.render(fields)
        client = _cache_client(self._cache, self.name)
        base = base_key(client, self.name, identity)
        transaction.on_commit(partial(self._delete, client, base), using=self._using)

    def stats(self) -> CacheStats:
        """This process's counts for this cache."""
        return self._counts.snapshot()

    def _fill(self, client: Any, keys: list[str], token: str, encoded: Any) -> None:
        try:
            stored = run_script(
                client.get_client(True), FILL_WITH_CLAIM, keys, [token, encoded, self._ttl_ms]
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
