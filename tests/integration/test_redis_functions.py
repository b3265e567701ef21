"""The lock's Lua as Redis functions, on real Redis: FCALL, reload, and the script fallback.

What runs is read from the server's own counters (``INFO commandstats``), so the tests
see which command Redis executed, not what the client meant to send.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_explicit.locks import _LIBRARY, LeaseLock


def calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def cycle(client: redis.Redis, prefix: str) -> tuple[int, int]:
    """acquire, extend, release; the two fencing tokens of two such cycles."""
    lock = LeaseLock(client, "report:day", ttl=5.0, prefix=prefix)
    first = lock.acquire()
    lock.extend()
    lock.release()
    second = lock.acquire()
    lock.release()
    assert not client.exists(lock.key)
    return first, second


def test_the_lock_runs_as_functions_of_one_loaded_library(redis_client, prefix) -> None:
    fcalls, evals = calls(redis_client, "fcall"), calls(redis_client, "evalsha")
    first, second = cycle(redis_client, prefix)
    assert second == first + 1
    assert calls(redis_client, "fcall") - fcalls == 5
    assert calls(redis_client, "evalsha") - evals == 0
    libraries = redis_client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", _LIBRARY.name)
    assert len(libraries) == 1  # named with its code's hash: one version, one library


def test_a_library_that_disappeared_is_loaded_again(redis_client, prefix) -> None:
    cycle(redis_client, prefix)  # loaded through this client
    redis_client.execute_command("FUNCTION", "DELETE", _LIBRARY.name)
    fcalls = calls(redis_client, "fcall")
    first, second = cycle(redis_client, prefix)  # the first call finds it missing
    assert second == first + 1
    # Five calls, one of them twice (missing, then again after the reload).
    assert calls(redis_client, "fcall") - fcalls == 6
    assert redis_client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", _LIBRARY.name)


@pytest.fixture
def client_without_functions(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """A Redis user that may run everything but FUNCTION (an ACL some hosts ship)."""
    user, password = f"explicit-test-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*",
                                 "+@all", "-function")
    pool_kwargs = redis_client.connection_pool.connection_kwargs
    client = redis.Redis(host=pool_kwargs["host"], port=pool_kwargs["port"],
                         db=pool_kwargs.get("db", 0), username=user, password=password)
    yield client
    client.close()
    redis_client.execute_command("ACL", "DELUSER", user)


def test_without_functions_the_same_lua_runs_as_scripts(
        redis_client, client_without_functions, prefix) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        client_without_functions.execute_command("FUNCTION", "LIST")  # the ACL holds
    fcalls, evals = calls(redis_client, "fcall"), calls(redis_client, "evalsha")
    first, second = cycle(client_without_functions, prefix)
    assert second == first + 1
    assert calls(redis_client, "fcall") - fcalls == 0
    assert calls(redis_client, "evalsha") - evals == 5
