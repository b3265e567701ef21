"""Our Lua as Redis functions, on real Redis: FCALL, reload, and the script fallback.

What runs is read from the server's own counters (``INFO commandstats``), so the tests
see which command Redis executed, not what the client meant to send. Those counters are
server-wide, so the tests run on a Redis of their own (a private ``redis-server`` on a
Unix socket): on the shared one, a worker left over from another test running its own
scripts once added to the count.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_explicit import redis_scripts
from celery_explicit.locks import LeaseLock


@pytest.fixture
def redis_client(private_redis: Path) -> Iterator[redis.Redis]:
    client = redis.Redis(unix_socket_path=str(private_redis))
    client.ping()
    yield client
    client.flushall()
    client.execute_command("FUNCTION", "FLUSH")
    client.close()


@pytest.fixture
def prefix() -> str:
    return f"explicit-test:{uuid.uuid4().hex[:8]}:"


def calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran ``command`` and it succeeded.

    A first EVALSHA of a script the server has not cached fails with NOSCRIPT (redis-py
    then loads it and calls again); that failure is counted in ``failed_calls``.
    """
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)) - failed(client, command)


def failed(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("failed_calls", 0))


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
    assert second > first
    assert calls(redis_client, "fcall") - fcalls == 5
    assert calls(redis_client, "evalsha") - evals == 0
    name = redis_scripts.library().name
    libraries = redis_client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", name)
    assert len(libraries) == 1  # named with its code's hash: one version, one library


def test_a_library_that_disappeared_is_loaded_again(redis_client, prefix) -> None:
    cycle(redis_client, prefix)  # loaded through this client
    redis_client.execute_command("FUNCTION", "DELETE", redis_scripts.library().name)
    fcalls, failures = calls(redis_client, "fcall"), failed(redis_client, "fcall")
    first, second = cycle(redis_client, prefix)  # the first call finds it missing
    assert second > first
    # Five calls, the first of them twice: missing, then again after the reload.
    assert failed(redis_client, "fcall") - failures == 1
    assert calls(redis_client, "fcall") - fcalls == 5
    name = redis_scripts.library().name
    assert redis_client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", name)


@pytest.fixture
def client_without_functions(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """A Redis user that may run everything but FUNCTION (an ACL some hosts ship)."""
    user, password = f"explicit-test-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    redis_client.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-function"
    )
    socket = redis_client.connection_pool.connection_kwargs["path"]
    client = redis.Redis(unix_socket_path=socket, username=user, password=password)
    yield client
    client.close()
    redis_client.execute_command("ACL", "DELUSER", user)


def test_without_functions_the_same_lua_runs_as_scripts(
    redis_client, client_without_functions, prefix
) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        client_without_functions.execute_command("FUNCTION", "LIST")  # the ACL holds
    fcalls, evals = calls(redis_client, "fcall"), calls(redis_client, "evalsha")
    first, second = cycle(client_without_functions, prefix)
    assert second > first
    assert calls(redis_client, "fcall") - fcalls == 0
    assert calls(redis_client, "evalsha") - evals == 5


# KEYS[1] - a counter   ARGV[1] - by how much   return the new value
INCREMENT = redis_scripts.Script("test_increment", "return redis.call('incrby', KEYS[1], ARGV[1])")
INCREMENTS = [
    (INCREMENT, ["explicit-test:counter"], [2]),
    (INCREMENT, ["explicit-test:counter"], [3]),
]


def deltas(client: redis.Redis, commands: tuple[str, ...]):  # type: ignore[no-untyped-def]
    before = {c: (calls(client, c), failed(client, c)) for c in commands}

    def delta(command: str) -> tuple[int, int]:
        done, refused = before[command]
        return calls(client, command) - done, failed(client, command) - refused

    return delta


def test_pipelined_calls_cost_one_round_trip_and_load_where_missing(redis_client) -> None:
    """``redis_scripts.call_many`` (the leases' heartbeat): an FCALL for each call, no
    ``SCRIPT EXISTS`` (which a pipeline handed a redis-py Script object would send),
    and the library loaded again when the server lost it."""
    delta = deltas(redis_client, ("fcall", "function|load", "script|exists", "evalsha"))
    assert redis_scripts.call_many(redis_client, INCREMENTS) == [2, 5]
    assert delta("fcall") == (2, 0)
    assert delta("function|load") == (1, 0)
    redis_client.execute_command("FUNCTION", "DELETE", redis_scripts.library().name)
    # The server lost the library: the pipeline finds both functions missing, loads
    # the library once and sends the pipeline again.
    assert redis_scripts.call_many(redis_client, INCREMENTS) == [7, 10]
    assert delta("fcall") == (4, 2)
    assert delta("function|load") == (2, 0)
    assert delta("script|exists") == (0, 0)
    assert delta("evalsha") == (0, 0)


def test_pipelined_scripts_without_functions_load_once_where_missing(
    redis_client, client_without_functions
) -> None:
    """The same pipeline as scripts: EVALSHA for each call; where the server has not
    seen the script (two NOSCRIPT replies) it is loaded once and the pipeline resent."""
    delta = deltas(redis_client, ("evalsha", "script|load", "script|exists", "fcall"))
    assert redis_scripts.call_many(client_without_functions, INCREMENTS) == [2, 5]
    assert delta("evalsha") == (2, 2)
    assert redis_scripts.call_many(client_without_functions, INCREMENTS) == [7, 10]
    assert delta("evalsha") == (4, 2)
    assert delta("script|load") == (1, 0)
    assert delta("script|exists") == (0, 0)
    assert delta("fcall") == (0, 0)


def test_what_was_loaded_is_kept_for_live_clients_only(private_redis) -> None:
    import gc

    def kept() -> int:
        gc.collect()
        return len(redis_scripts._clients)

    before = kept()
    clients = [redis.Redis(unix_socket_path=str(private_redis)) for _ in range(20)]
    for client in clients:
        assert redis_scripts.call(client, INCREMENT, ["explicit-test:kept"], [1])
    assert kept() == before + 20
    # Forgotten with their clients; a new client is probed and remembered.
    for client in clients:
        client.close()
    del clients, client
    assert kept() == before
    fresh = redis.Redis(unix_socket_path=str(private_redis))
    assert redis_scripts.call(fresh, INCREMENT, ["explicit-test:kept"], [1]) == 21
    assert kept() == before + 1
    fresh.flushall()


def test_an_entry_left_by_another_client_at_the_same_id_is_not_trusted(redis_client) -> None:
    import weakref

    other = redis.Redis(unix_socket_path=redis_client.connection_pool.connection_kwargs["path"])
    lib = redis_scripts.library()
    # What a dead client's entry looks like to a new client given its id.
    redis_scripts._clients[id(redis_client)] = (weakref.ref(other), lib.name)
    redis_client.execute_command("FUNCTION", "FLUSH")
    fcall = deltas(redis_client, ("fcall",))
    assert redis_scripts.call(redis_client, INCREMENT, ["explicit-test:same-id"], [4]) == 4
    # Probed and loaded first: no FCALL refused for a library that was not there.
    assert fcall("fcall") == (1, 0)
    other.close()
