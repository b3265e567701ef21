"""What django_outbox.cache.versioned counts: Prometheus counters, and the same counts in process.

Declared here rather than in celery_explicit.metrics: the cache is a django_outbox
feature, and a reader looking for its counters opens the cache's own modules.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import Counter

__all__ = ["CacheStats", "Counts"]

reads = Counter(
    "explicit_cache_reads_total",
    "Reads through django_outbox.cache.versioned, by outcome: hit (one round trip) or miss "
    "(the source was read).",
    ["cache", "outcome"],
)
fills = Counter(
    "explicit_cache_fills_total",
    "Values written after a miss: stored, or refused because the cache already held a "
    "newer version (versioned) or the fill claim was invalidated (cache-aside).",
    ["cache", "outcome"],
)
cache_stale = Counter(
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


class Counts:
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
            "fill": cache_stale.labels(name, "fill"),
            "verify": cache_stale.labels(name, "verify"),
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
