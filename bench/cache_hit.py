"""Reads per second of a versioned cache hit against a plain django-redis ``cache.get``
of the same value.

``VersionedCache.get()`` on a hit (one GET of the ``(version, value)`` pair) vs
``django.core.cache.cache.get()`` of the same pickled value under a plain key. Target
(P5 in docs/performance.md): versioned/plain >= 0.9. For reference, two layouts not
taken are timed too, with value keys named by version (``...:v7``), where the version
must be read before the value: one EVALSHA of a script that reads both, and two GETs.
The round trips per read are counted (responses read from Redis by this process).

Rounds of interleaved chunks (100 reads of each side in turn) against the cache of
bench/settings.py (django-redis, Redis on 127.0.0.1:6379 db 14), 100 entities, every
read a hit.

    scripts/bench cache_hit.py [--ops 5000] [--rounds 7]
    make bench-p5
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from typing import Any

from common import ratio_line, setup_django, summary

ENTITIES = 100


CHUNK = 100


def rate(fn: Callable[[int], Any], n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i % ENTITIES)
    return n / (time.perf_counter() - start)


def interleaved(sides: dict[str, Callable[[int], Any]], n: int) -> dict[str, float]:
    """One round: the sides take turns in chunks of CHUNK reads, so that a burst of load
    from elsewhere on the machine slows all of them alike; the rate of each side over
    its n reads."""
    spent = dict.fromkeys(sides, 0.0)
    for chunk in range(n // CHUNK):
        for name, fn in sides.items():
            start = time.perf_counter()
            for i in range(chunk * CHUNK, (chunk + 1) * CHUNK):
                fn(i % ENTITIES)
            spent[name] += time.perf_counter() - start
    return {name: (n // CHUNK) * CHUNK / seconds for name, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    setup_django()

    import redis
    from django.core.cache import cache, caches
    from django_redis import get_redis_connection

    from django_outbox.cache.versioned import VersionedCache

    tag = uuid.uuid4().hex[:6]
    profile = {"name": "Ada Lovelace", "email": "ada@example.com", "bio": "x" * 200}
    profiles = VersionedCache(
        f"bench_profile_{tag}:{{user_id}}", source=lambda *, user_id: (profile, 7)
    )
    client = get_redis_connection("default")
    for i in range(ENTITIES):
        profiles.get(user_id=i)  # miss, fill: every timed read below is a hit
        cache.set(f"p5_plain_{tag}:{i}", profile, timeout=None)
        cache.set(f"p5_keyed_{tag}:{i}:ver", 7, timeout=None)
        cache.set(f"p5_keyed_{tag}:{i}:v7", profile, timeout=None)
    assert profiles.stats().misses == ENTITIES
    # KEYS[1] - the version key; ARGV[1] - the value key without its version
    # return {version, value at that version}, false when no version is cached
    read_keyed = client.register_script("""
local version = redis.call('get', KEYS[1])
if not version then
    return false
end
return {version, redis.call('get', ARGV[1] .. version)}
""")

    def ours(i: int) -> Any:
        return profiles.get(user_id=i)

    def plain(i: int) -> Any:
        return cache.get(f"p5_plain_{tag}:{i}")

    def keyed_script(i: int) -> Any:
        django_redis_client = caches["default"].client
        base = django_redis_client.make_key(f"p5_keyed_{tag}:{i}")
        _version, raw = read_keyed(keys=[f"{base}:ver"], args=[f"{base}:v"])
        return django_redis_client.decode(raw)

    def keyed_two_gets(i: int) -> Any:
        version = cache.get(f"p5_keyed_{tag}:{i}:ver")
        return cache.get(f"p5_keyed_{tag}:{i}:v{version}")

    sides: dict[str, Callable[[int], Any]] = {
        "versioned get (1 GET)": ours,
        "plain cache.get (1 GET)": plain,
        ":v<N> keys, 1 EVALSHA": keyed_script,
        ":v<N> keys, 2 GETs": keyed_two_gets,
    }
    assert ours(1) == plain(1) == keyed_script(1) == keyed_two_gets(1) == profile
    for fn in sides.values():
        rate(fn, 1000)  # warm-up: script cached in Redis, connections open
    results: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, measured in interleaved(sides, args.ops).items():
            results[name].append(measured)

    # Round trips, counted after the timing so the counter costs the timed loops nothing.
    responses = [0]
    original = redis.connection.AbstractConnection.read_response

    def counted(self: Any, *a: Any, **kw: Any) -> Any:
        responses[0] += 1
        return original(self, *a, **kw)

    redis.connection.AbstractConnection.read_response = counted  # type: ignore[method-assign]
    trips = {}
    for name, fn in sides.items():
        before = responses[0]
        rate(fn, 1000)
        trips[name] = (responses[0] - before) / 1000
    redis.connection.AbstractConnection.read_response = original  # type: ignore[method-assign]

    for name, rates in results.items():
        print(f"{summary(name, rates)}   round trips/read {trips[name]:.2f}")
    plain_rates = results["plain cache.get (1 GET)"]
    for name, target in (
        ((names := list(sides))[0], "target >= 0.9"),
        (names[2], ""),
        (names[3], ""),
    ):
        ratios = [o / p for o, p in zip(results[name], plain_rates, strict=True)]
        print(ratio_line(f"P5 {name} / plain cache.get", ratios, target))
    keys = [
        key
        for kind in ("profile", "plain", "keyed")
        for key in client.scan_iter(match=f"*p5_{kind}_{tag}:*")
    ]
    if keys:
        client.delete(*keys)


if __name__ == "__main__":
    main()
