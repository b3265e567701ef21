"""django_outbox.cache.versioned on real Redis (django-redis) and PostgreSQL.

One GET per hit, fills for the source's version only, bumps and invalidations after
commit (never inside the transaction, never after a rollback), and the race a plain
cache-aside loses: a reader that read the row before a write committed storing its old
value after the write's invalidation.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.cache import cache as django_cache
from django.db import connections, transaction
from django_redis import get_redis_connection

from celery_explicit import redis_scripts
from django_outbox.cache.versioned import (
    CacheAside,
    CacheConfigError,
    CacheKeyError,
    VersionedCache,
)
from tests.testapp.models import CachedProfile

pytestmark = pytest.mark.django_db(transaction=True)

TEMPLATE = "user_profile:{user_id}"


@pytest.fixture
def prefix(settings: Any) -> Iterator[str]:
    """This test's own KEY_PREFIX on the django-redis cache; its keys are deleted after."""
    p = f"explicit-test-{uuid.uuid4().hex[:8]}"
    settings.CACHES = {
        "default": {**settings.CACHES["default"], "KEY_PREFIX": p},
        "locmem": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    yield p
    client = get_redis_connection("default")
    keys = list(client.scan_iter(match=f"{p}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def r(prefix: str) -> redis.Redis:
    return get_redis_connection("default")


def load_profile(*, user_id: int) -> tuple[dict[str, Any], int]:
    row = CachedProfile.objects.get(user_id=user_id)
    return {"name": row.name, "version": row.version}, row.version


def rename(profiles: VersionedCache[Any], user_id: int, name: str) -> int:
    """A committed write, bumped after commit, as application code does it."""
    with transaction.atomic():
        row = CachedProfile.objects.select_for_update().get(user_id=user_id)
        row.name, row.version = name, row.version + 1
        row.save(update_fields=["name", "version"])
        profiles.bump(row.version, user_id=user_id)
    return row.version


class CountingSource:
    """The real source, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *, user_id: int) -> tuple[dict[str, Any], int]:
        self.calls += 1
        return load_profile(user_id=user_id)


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Responses read from Redis by this process: one per round trip (a spy: every call
    goes to the real connection)."""
    count = [0]
    original = redis.connection.AbstractConnection.read_response

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", counted)
    return lambda: count[0]


def test_a_miss_fills_and_a_hit_costs_one_round_trip_like_cache_get(
    r: redis.Redis, prefix: str, round_trips: Callable[[], int]
) -> None:
    CachedProfile.objects.create(user_id=1, name="Ada", version=3)
    source = CountingSource()
    profiles = VersionedCache(TEMPLATE, source=source)
    assert profiles.get_versioned(user_id=1) == ({"name": "Ada", "version": 3}, 3)
    assert source.calls == 1
    assert r.get(f"{prefix}:1:user_profile:1:ver") == b"3"

    django_cache.set("plain:1", {"name": "Ada", "version": 3})
    before = round_trips()
    for _ in range(50):
        assert profiles.get(user_id=1) == {"name": "Ada", "version": 3}
    ours = round_trips() - before
    before = round_trips()
    for _ in range(50):
        assert django_cache.get("plain:1") == {"name": "Ada", "version": 3}
    plain = round_trips() - before

    assert source.calls == 1
    assert ours == plain == 50
    stats = profiles.stats()
    assert (stats.hits, stats.misses, stats.stored, stats.stale) == (50, 1, 1, 0)


def test_keys_ttls_and_serializer(r: redis.Redis, prefix: str) -> None:
    CachedProfile.objects.create(user_id=2, name="Grace", version=1)
    profiles = VersionedCache(TEMPLATE, source=load_profile, timeout=60.0)
    profiles.get(user_id=2)
    # The version key outlives values: a slow reader can never write an older version
    # after it expired.
    assert r.pttl(f"{prefix}:1:user_profile:2:ver") == -1
    assert 59_000 < r.pttl(f"{prefix}:1:user_profile:2") <= 60_000
    # The cache's own serializer: plain cache.get reads the (version, value) pair.
    assert django_cache.get("user_profile:2") == (1, {"name": "Grace", "version": 1})


def test_bump_is_invisible_inside_the_transaction_and_visible_after_commit(
    r: redis.Redis, prefix: str
) -> None:
    CachedProfile.objects.create(user_id=3, name="old", version=1)
    profiles = VersionedCache(TEMPLATE, source=load_profile)
    profiles.get(user_id=3)
    with transaction.atomic():
        row = CachedProfile.objects.select_for_update().get(user_id=3)
        row.name, row.version = "new", 2
        row.save()
        profiles.bump(2, user_id=3)
        assert r.get(f"{prefix}:1:user_profile:3:ver") == b"1"
        assert profiles.get(user_id=3)["name"] == "old"
    assert r.get(f"{prefix}:1:user_profile:3:ver") == b"2"
    # The bump deleted the previous version's value: nothing to wildcard-delete later.
    assert not r.exists(f"{prefix}:1:user_profile:3")
    assert profiles.get_versioned(user_id=3) == ({"name": "new", "version": 2}, 2)


def test_a_rollback_bumps_nothing(r: redis.Redis, prefix: str) -> None:
    CachedProfile.objects.create(user_id=4, name="old", version=1)
    profiles = VersionedCache(TEMPLATE, source=load_profile)
    profiles.get(user_id=4)
    with pytest.raises(RuntimeError), transaction.atomic():
        CachedProfile.objects.filter(user_id=4).update(name="new", version=2)
        profiles.bump(2, user_id=4)
        raise RuntimeError("the write failed after the bump was asked for")
    with transaction.atomic():  # a savepoint rolled back inside a committed transaction
        with pytest.raises(RuntimeError), transaction.atomic():
            CachedProfile.objects.filter(user_id=4).update(name="new", version=2)
            profiles.bump(2, user_id=4)
            raise RuntimeError("inner block failed")
        CachedProfile.objects.filter(user_id=4).update(name="kept")
    assert r.get(f"{prefix}:1:user_profile:4:ver") == b"1"
    assert profiles.get_versioned(user_id=4) == ({"name": "old", "version": 1}, 1)


def test_bumps_only_move_forward_even_past_2_to_the_53(r: redis.Redis, prefix: str) -> None:
    profiles = VersionedCache(TEMPLATE, source=load_profile)
    key = f"{prefix}:1:user_profile:5:ver"
    for version, expected in [
        (9, 9),
        (10, 10),
        (9, 10),
        (10, 10),
        (2**60, 2**60),
        (2**60 + 1, 2**60 + 1),
        (2**60, 2**60 + 1),
    ]:
        profiles.bump(version, user_id=5)  # outside a transaction: at once
        assert r.get(key) == str(expected).encode(), version


def test_a_fill_older_than_the_cached_version_is_refused(r: redis.Redis, prefix: str) -> None:
    answers = iter([({"name": "v1"}, 1)])
    profiles = VersionedCache(TEMPLATE, source=lambda *, user_id: next(answers))
    profiles.bump(2, user_id=6)  # committed elsewhere; its value not cached yet
    # This reader's source read predates the commit: it gets its own (older) value,
    # which was current when it read, but the cache stays on version 2.
    assert profiles.get_versioned(user_id=6) == ({"name": "v1"}, 1)
    assert r.get(f"{prefix}:1:user_profile:6:ver") == b"2"
    assert not r.exists(f"{prefix}:1:user_profile:6")
    assert profiles.stats().refused == 1


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_fill_inside_a_transaction_waits_for_its_commit(
    r: redis.Redis, prefix: str, outcome: str
) -> None:
    CachedProfile.objects.create(user_id=7, name="old", version=1)
    profiles = VersionedCache(TEMPLATE, source=load_profile)
    expect = pytest.raises(RuntimeError) if outcome == "rollback" else nullcontext()
    with expect, transaction.atomic():
        CachedProfile.objects.filter(user_id=7).update(name="uncommitted", version=2)
        # The source reads this transaction's own write; storing it now would show it
        # to everyone before COMMIT, and keep it after a ROLLBACK.
        assert profiles.get(user_id=7)["name"] == "uncommitted"
        assert not r.exists(f"{prefix}:1:user_profile:7:ver")
        if outcome == "rollback":
            raise RuntimeError("rolled back")
    if outcome == "commit":
        assert r.get(f"{prefix}:1:user_profile:7:ver") == b"2"
    else:
        assert not r.exists(f"{prefix}:1:user_profile:7:ver")
        assert profiles.get(user_id=7)["name"] == "old"


def test_errors_from_the_source_and_the_backend_name_the_cache(prefix: str) -> None:
    CachedProfile.objects.create(user_id=8, name="x", version=1)
    bad = VersionedCache(TEMPLATE, source=lambda *, user_id: ({"x": 1}, -1))
    with pytest.raises(
        CacheKeyError,
        match="Cache user_profile: version returned by the "
        "source must be a non-negative integer, got -1",
    ):
        bad.get(user_id=8)
    untupled = VersionedCache(TEMPLATE, source=lambda *, user_id: {"x": 1})  # type: ignore
    with pytest.raises(CacheKeyError, match=r"must return \(value, version\)"):
        untupled.get(user_id=8)
    on_locmem = VersionedCache(TEMPLATE, source=load_profile, cache="locmem")
    with pytest.raises(
        CacheConfigError, match="cache alias 'locmem' is not a django-redis"
    ) as caught:
        on_locmem.get(user_id=8)
    assert (caught.value.cache_name, caught.value.field) == ("user_profile", "cache")


def test_a_bump_that_fails_after_commit_is_counted_not_raised(settings: Any) -> None:
    # A real failure: a Redis that refuses connections, not a mock.
    settings.CACHES = {
        **settings.CACHES,
        "down": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"},
    }
    CachedProfile.objects.create(user_id=12, name="old", version=1)
    profiles = VersionedCache(TEMPLATE, source=load_profile, cache="down")
    with transaction.atomic():
        CachedProfile.objects.filter(user_id=12).update(name="new", version=2)
        profiles.bump(2, user_id=12)
    # The write committed; raising here would report a failure for it.
    assert CachedProfile.objects.get(user_id=12).version == 2
    assert profiles.stats().invalidation_failures == 1
    with pytest.raises(redis.ConnectionError):  # reads do not hide a cache outage
        profiles.get(user_id=12)


def test_a_lost_library_is_loaded_again_by_the_call_that_finds_it_missing(
    tmp_path: Path,
) -> None:
    # The cache's scripts run as functions of the package's library: a Redis that lost
    # it (a restart without persistence, FUNCTION FLUSH, a promoted replica) has it
    # loaded again by the first call, which then succeeds. Functions need Redis 7: a
    # private one from PATH (the matrix's Redis 6.2 sessions serve the cache from 6.2).
    from tests.support.servers import PrivateRedis

    server = PrivateRedis(tmp_path / "redis7", durable=False).start()
    try:
        r = redis.Redis.from_url(server.url)
        assert int(r.info("server")["redis_version"].split(".")[0]) >= 7
        _library_comes_back(r)
    finally:
        server.kill()


def _library_comes_back(r: redis.Redis) -> None:
    fresh = redis_scripts.Script(f"test_fresh_{uuid.uuid4().hex[:8]}", "return 'ok'")
    assert redis_scripts.call(r, fresh, [], []) == b"ok"
    r.execute_command("FUNCTION", "DELETE", redis_scripts.library().name)
    assert not r.execute_command("FUNCTION", "LIST", "LIBRARYNAME", redis_scripts.library().name)
    assert redis_scripts.call(r, fresh, [], []) == b"ok"
    assert r.execute_command("FUNCTION", "LIST", "LIBRARYNAME", redis_scripts.library().name)


# --- the race a version (or a lease) closes ---------------------------------------------


def naive_reader(user_id: int, source: Callable[..., Any]) -> Any:
    """The negative control: cache.get, then the source and cache.set on a miss."""
    value = django_cache.get(f"naive:{user_id}")
    if value is None:
        value = source(user_id=user_id)
        django_cache.set(f"naive:{user_id}", value)
    return value


@pytest.mark.parametrize("variant", ["versioned", "cache-aside", "negative-control-naive"])
def test_a_reader_that_read_before_the_commit_cannot_cache_its_old_value(
    prefix: str, variant: str
) -> None:
    """Reader: miss, read the row (old), pause. Writer: commit, then bump / invalidate.
    Reader: store. The next reader must see the new row, except in the naive control."""
    CachedProfile.objects.create(user_id=9, name="old", version=1)
    has_read, may_store = threading.Event(), threading.Event()

    def paused(**fields: Any) -> Any:
        value = load_profile(**fields)
        if threading.current_thread().name == "slow-reader":
            has_read.set()
            assert may_store.wait(10)
        return value if variant == "versioned" else value[0]

    if variant == "versioned":
        profiles: Any = VersionedCache(TEMPLATE, source=paused)
        read: Callable[[], Any] = lambda: profiles.get(user_id=9)  # noqa: E731
        invalidate: Callable[[], None] = lambda: profiles.bump(2, user_id=9)  # noqa: E731
    elif variant == "cache-aside":
        profiles = CacheAside("user_name:{user_id}", source=paused)
        read = lambda: profiles.get(user_id=9)  # noqa: E731
        invalidate = lambda: profiles.invalidate(user_id=9)  # noqa: E731
    else:
        read = lambda: naive_reader(9, paused)  # noqa: E731
        invalidate = lambda: transaction.on_commit(  # noqa: E731
            lambda: django_cache.delete("naive:9")
        )

    seen: list[Any] = []

    def slow_reader() -> None:
        try:
            seen.append(read())
        finally:
            connections.close_all()

    thread = threading.Thread(target=slow_reader, name="slow-reader")
    thread.start()
    assert has_read.wait(10)
    with transaction.atomic():
        CachedProfile.objects.filter(user_id=9).update(name="new", version=2)
        invalidate()
    may_store.set()
    thread.join(10)
    assert seen[0]["name"] == "old"  # it read before the commit: that is its answer
    after = read()
    if variant == "negative-control-naive":
        assert after["name"] == "old"  # stale until the next write: the test can fail
    else:
        assert after["name"] == "new"
        assert profiles.stats().refused == 1


# --- cache-aside -----------------------------------------------------------------------


def test_cache_aside_reads_through_and_invalidates_after_commit_only(
    r: redis.Redis, prefix: str, round_trips: Callable[[], int]
) -> None:
    CachedProfile.objects.create(user_id=10, name="old", version=1)
    names = CacheAside(
        "user_name:{user_id}",
        source=lambda *, user_id: load_profile(user_id=user_id)[0]["name"],
        timeout=30.0,
    )
    assert names.get(user_id=10) == "old"
    assert 29_000 < r.pttl(f"{prefix}:1:user_name:10") <= 30_000
    assert not r.exists(f"{prefix}:1:user_name:10:lease")  # given back by the fill
    before = round_trips()
    assert names.get(user_id=10) == "old"
    assert round_trips() - before == 1

    with pytest.raises(RuntimeError), transaction.atomic():
        CachedProfile.objects.filter(user_id=10).update(name="new")
        names.invalidate(user_id=10)
        raise RuntimeError("rolled back")
    assert names.get(user_id=10) == "old"
    with transaction.atomic():
        CachedProfile.objects.filter(user_id=10).update(name="new")
        names.invalidate(user_id=10)
        assert names.get(user_id=10) == "old"  # not before commit
    assert names.get(user_id=10) == "new"
    stats = names.stats()
    assert (stats.hits, stats.misses, stats.stored) == (3, 2, 2)


def test_cache_aside_only_one_reader_fills_at_a_time(r: redis.Redis, prefix: str) -> None:
    names = CacheAside("user_name:{user_id}", source=lambda *, user_id: "x", lease=5.0)
    r.set(f"{prefix}:1:user_name:11:lease", "another-reader", px=5000)
    assert names.get(user_id=11) == "x"  # read through, not stored
    assert not r.exists(f"{prefix}:1:user_name:11")
    assert names.stats().stored == 0
