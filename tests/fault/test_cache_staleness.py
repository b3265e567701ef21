"""Fault tests: readers hammer a cached row while its version moves; lost bumps.

History: reader threads read user 1 through the cache in a loop while the writer commits
``WRITES`` renames, each ``name-<version>``. Before each read a reader notes the newest
version whose bump (or invalidation) had completed: the floor. After the run every read
is checked: an older version than its floor is a stale read; a name that does not match
its version is a torn read. Real Redis and PostgreSQL; the source is slow (``SOURCE_DELAY``)
so that reads on the miss path overlap commits.

The negative controls, a bump before COMMIT and a plain cache-aside (cache.get/cache.set,
cache.delete after commit), produce stale reads under the same history: the check can fail.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.core.cache import cache as django_cache
from django.db import connections, transaction
from django_redis import get_redis_connection
from prometheus_client import REGISTRY

from django_outbox.cache.versioned import CacheAside, VersionedCache
from tests.testapp.models import CachedProfile

pytestmark = pytest.mark.django_db(transaction=True)

WRITES, READERS = 150, 4
# The source takes 3 ms; a write holds its transaction 1 ms; the writer pauses 0-6 ms
# between writes (seeded), so some reads of the source straddle a commit and some
# versions stay long enough to be hit.
SOURCE_DELAY, WRITE_HOLD, MAX_GAP = 0.003, 0.001, 0.006


@pytest.fixture
def prefix(settings: Any) -> Iterator[str]:
    """This test's own KEY_PREFIX on the django-redis cache; its keys are deleted after."""
    p = f"explicit-test-{uuid.uuid4().hex[:8]}"
    settings.CACHES = {"default": {**settings.CACHES["default"], "KEY_PREFIX": p}}
    yield p
    client = get_redis_connection("default")
    keys = list(client.scan_iter(match=f"{p}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def r(prefix: str) -> redis.Redis:
    return get_redis_connection("default")


def row(user_id: int) -> dict[str, Any]:
    profile = CachedProfile.objects.get(user_id=user_id)
    return {"name": profile.name, "version": profile.version}


def slow_row(*, user_id: int) -> dict[str, Any]:
    value = row(user_id)
    time.sleep(SOURCE_DELAY)
    return value


def commit(
    version: int,
    *,
    before: Callable[[], Any] = lambda: None,
    inside: Callable[[], Any] = lambda: None,
) -> None:
    before()
    with transaction.atomic():
        CachedProfile.objects.filter(user_id=1).update(name=f"name-{version}", version=version)
        inside()
        time.sleep(WRITE_HOLD)


def naive_read() -> dict[str, Any]:
    value: dict[str, Any] | None = django_cache.get("naive:1")
    if value is None:
        value = slow_row(user_id=1)
        django_cache.set("naive:1", value)
    return value


VARIANTS = [
    "versioned",
    "cache-aside",
    "negative-control-bump-before-commit",
    "negative-control-naive-cache-aside",
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_read_returns_a_version_older_than_the_last_bump(prefix: str, variant: str) -> None:
    CachedProfile.objects.create(user_id=1, name="name-1", version=1)
    profiles = VersionedCache(
        "user_profile:{user_id}",
        source=lambda *, user_id: (v := slow_row(user_id=user_id), v["version"]),
    )
    names = CacheAside("user_name:{user_id}", source=slow_row)
    floor = [1]  # the newest version whose bump or invalidation has completed

    def visible(version: int) -> None:
        """Called right after the cache step: its hook runs once the step's has (hooks run
        in order; outside a transaction both run at once)."""
        transaction.on_commit(lambda: floor.__setitem__(0, version))

    read: Callable[[], dict[str, Any]]
    write: Callable[[int], None]
    if variant == "versioned":
        read = lambda: profiles.get(user_id=1)  # noqa: E731
        write = lambda v: commit(  # noqa: E731
            v,
            inside=lambda: (
                profiles.bump(v, user_id=1),
                visible(v),
            ),
        )
    elif variant == "cache-aside":
        read = lambda: names.get(user_id=1)  # noqa: E731
        write = lambda v: commit(  # noqa: E731
            v,
            inside=lambda: (
                names.invalidate(user_id=1),
                visible(v),
            ),
        )
    elif variant == "negative-control-bump-before-commit":
        read = lambda: profiles.get(user_id=1)  # noqa: E731
        # Outside a transaction bump() applies at once: here, before the write commits.
        write = lambda v: commit(  # noqa: E731
            v,
            before=lambda: (
                profiles.bump(v, user_id=1),
                visible(v),
            ),
        )
    else:
        read = naive_read
        write = lambda v: commit(  # noqa: E731
            v,
            inside=lambda: (
                transaction.on_commit(lambda: django_cache.delete("naive:1")),
                visible(v),
            ),
        )

    stop = threading.Event()
    tallies: list[Tally[str]] = []
    failures: list[BaseException] = []

    def reader() -> None:
        outcomes: Tally[str] = Tally()
        tallies.append(outcomes)
        try:
            while not stop.is_set():
                low = floor[0]
                value = read()
                if value["name"] != f"name-{value['version']}":
                    outcomes["torn"] += 1
                outcomes["stale" if value["version"] < low else "current"] += 1
        except BaseException as exc:  # reported by the main thread, which asserts
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=reader) for _ in range(READERS)]
    for thread in threads:
        thread.start()
    gaps = random.Random(20261129)
    try:
        for version in range(2, WRITES + 2):
            write(version)
            time.sleep(gaps.uniform(0, MAX_GAP))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures, failures
    outcomes = sum(tallies, Tally())
    assert outcomes["torn"] == 0
    assert outcomes["current"] > WRITES  # the readers really ran alongside the writes
    if variant.startswith("negative-control"):
        assert outcomes["stale"] > 0, outcomes
        return
    assert outcomes["stale"] == 0, outcomes
    assert read()["version"] == WRITES + 1
    stats = (profiles if variant == "versioned" else names).stats()
    # Both paths ran, and the guard was needed: fills from a source read older than a
    # completed bump or invalidation were refused.
    assert stats.hits > 0 and stats.misses > 0, stats
    assert stats.refused > 0, stats


# --- the staleness indicator -------------------------------------------------------------


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def load(*, user_id: int) -> tuple[dict[str, Any], int]:
    value = row(user_id)
    return value, value["version"]


def test_verify_counts_exactly_the_entities_whose_last_bump_was_lost(
    prefix: str, r: redis.Redis
) -> None:
    """20 profiles, 3 committed writes each; each bump is lost with probability 0.3 (a
    worker killed between COMMIT and its on_commit hook). An entity is stale exactly when
    its last bump was lost; verify() must count those, and only those, and repair them."""
    entities, writes = range(20), 3
    name = f"profile_{uuid.uuid4().hex[:6]}"
    profiles = VersionedCache(name + ":{user_id}", source=load)
    CachedProfile.objects.bulk_create(
        CachedProfile(user_id=i, name="v1", version=1) for i in entities
    )
    for i in entities:
        profiles.get(user_id=i)
    dice = random.Random(20261129)
    last_bump_lost = set()
    for i in entities:
        for version in range(2, writes + 2):
            lost = dice.random() < 0.3
            with transaction.atomic():
                CachedProfile.objects.filter(user_id=i).update(name=f"v{version}", version=version)
                if not lost:
                    profiles.bump(version, user_id=i)
            last_bump_lost.discard(i)
            if lost:
                last_bump_lost.add(i)
    assert 0 < len(last_bump_lost) < len(entities)  # the seed gives both kinds
    stale_before = metric("explicit_cache_stale_total", cache=name, seen_by="verify")

    found = {i for i in entities if profiles.verify(user_id=i).stale}

    assert found == last_bump_lost
    stats = profiles.stats()
    assert stats.stale == len(last_bump_lost)
    assert stats.compared == len(entities) * 2  # the first fills, then one verify each
    assert metric("explicit_cache_stale_total", cache=name, seen_by="verify") - stale_before == len(
        last_bump_lost
    )
    # Repaired: every reader now gets the source's version, and nothing is stale anymore.
    for i in entities:
        assert profiles.get_versioned(user_id=i)[1] == writes + 1
    assert not any(profiles.verify(user_id=i).stale for i in entities)
    assert profiles.stats().stale == len(last_bump_lost)


def test_a_lost_bump_serves_the_old_version_until_the_timeout_then_a_fill_counts_it(
    prefix: str, r: redis.Redis
) -> None:
    name = f"profile_{uuid.uuid4().hex[:6]}"
    # Long enough to outlast the fill, the UPDATE and the second read on a loaded machine.
    profiles = VersionedCache(name + ":{user_id}", source=load, timeout=2.0)
    CachedProfile.objects.create(user_id=1, name="v1", version=1)
    assert profiles.get_versioned(user_id=1)[1] == 1
    CachedProfile.objects.filter(user_id=1).update(name="v2", version=2)  # no bump: lost
    assert profiles.get_versioned(user_id=1)[1] == 1  # stale: what the indicator is for
    assert profiles.stats().stale == 0  # a hit cannot know

    value_key = f"{prefix}:1:{name}:1"
    deadline = time.monotonic() + 5
    while r.exists(value_key):  # Redis expires it on its own clock
        assert time.monotonic() < deadline, "the value outlived its timeout"
        time.sleep(0.05)
    stale_before = metric("explicit_cache_stale_total", cache=name, seen_by="fill")

    assert profiles.get_versioned(user_id=1) == ({"name": "v2", "version": 2}, 2)

    assert profiles.stats().stale == 1
    assert metric("explicit_cache_stale_total", cache=name, seen_by="fill") - stale_before == 1
    assert r.get(f"{prefix}:1:{name}:1:ver") == b"2"
    assert profiles.get_versioned(user_id=1)[1] == 2
    assert profiles.stats().stale == 1
