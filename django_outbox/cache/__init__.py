"""Versioned cache helpers on django-redis: a write bumps a version, a read never serves a
value older than the version it saw.

- ``versioned``: ``VersionedCache`` and ``CacheAside`` (the fill claim and verification).
- ``keys``: how cache keys are built and validated.
- ``scripts``: the Lua the cache runs in Redis.
- ``stats``: ``CacheStats``, hits, misses and stale reads refused.
"""
