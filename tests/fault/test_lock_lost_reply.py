"""A lock's acquisition whose reply is lost, on real Redis behind a proxy that drops it.

The acquire runs on the server; the proxy then closes the connection instead of
passing the reply on, and redis-py, which retries a command on a dropped connection,
sends the same acquisition again. Without care the retry finds the lock set (by itself)
and is refused: the caller is told the lock is taken, and nobody holds it until its TTL.
Counted over many dropped replies, with a negative control: the same fault against a
plain ``SET NX`` acquisition, which it must defeat every time.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_explicit import redis_scripts
from celery_explicit.errors import LockNotAcquired
from celery_explicit.locks import LeaseLock

FAULTS = 20

# The acquisition without the retry's check: what the fault defeats.
NAIVE_ACQUIRE = redis_scripts.Script(
    "test_naive_lock_acquire",
    """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return false
end
return redis.call('incr', KEYS[2])
""",
)


class ReplyDroppingProxy:
    """A TCP proxy to Redis that, while armed, drops the reply to the next command
    naming ``marker`` and closes that connection (both ways), once per arming."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.marker: bytes | None = None
        self.dropped = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes) -> None:
        with self._lock:
            self.marker = marker

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            pending = threading.Event()  # the command whose reply is to be dropped was sent
            threading.Thread(target=self._up, args=(client, server, pending), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, pending), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, pending: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:
                    if self.marker is not None and b"FCALL" in data and self.marker in data:
                        self.marker = None
                        pending.set()
                server.sendall(data)
        except OSError:
            pass

    def _down(self, server: socket.socket, client: socket.socket, pending: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if pending.is_set():
                    # redis-py waits for a command's reply before its next one: this is it.
                    with self._lock:
                        self.dropped += 1
                    break
                client.sendall(data)
        except OSError:
            pass
        for end in (client, server):
            # shutdown, not only close: the other thread's recv on it must wake now, and
            # the client see the connection drop at once.
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxied(redis_client: redis.Redis) -> Iterator[tuple[ReplyDroppingProxy, redis.Redis]]:
    upstream = redis_client.connection_pool.connection_kwargs
    proxy = ReplyDroppingProxy((upstream["host"], upstream["port"]))
    # redis-py's own retry on a dropped connection, without its backoff's sleeps.
    retry = Retry(NoBackoff(), 3)
    client = redis.Redis(host="127.0.0.1", port=proxy.port, db=upstream["db"], retry=retry)
    # The library loaded before any reply is dropped (its code names every function).
    warm = f"explicit-test:warm:{uuid.uuid4().hex[:8]}"
    redis_scripts.call(client, NAIVE_ACQUIRE, [warm, warm + ":fence"], ["w", 1000])
    redis_client.delete(warm, warm + ":fence")
    yield proxy, client
    client.close()
    proxy.close()


def test_an_acquisition_whose_reply_was_lost_holds_the_lock_on_retry(proxied, redis_client) -> None:
    proxy, client = proxied
    prefix = f"explicit-test:{uuid.uuid4().hex[:8]}:"
    name = redis_scripts.library().function_names["lock_acquire"].encode()
    outcomes = {"held": 0, "refused": 0}
    for i in range(FAULTS):
        lock = LeaseLock(client, f"lost-reply:{i}", ttl=30.0, prefix=prefix)
        proxy.arm(name)
        try:
            fence = lock.acquire()
        except LockNotAcquired:
            outcomes["refused"] += 1  # by the lock its own first send set
            redis_client.delete(lock.key)
            continue
        value = redis_client.get(lock.key)
        assert value is not None and value.decode().startswith(lock.token or "?")
        assert fence == int(redis_client.get(lock.fence_key) or 0)
        outcomes["held"] += 1
        lock.release()
        assert not redis_client.exists(lock.key)
    assert proxy.dropped == FAULTS  # every acquisition lost its first reply
    assert outcomes == {"held": FAULTS, "refused": 0}


def test_negative_control_a_plain_set_nx_acquisition_is_refused_on_retry(
    proxied, redis_client
) -> None:
    proxy, client = proxied
    prefix = f"explicit-test:{uuid.uuid4().hex[:8]}:"
    name = redis_scripts.library().function_names[NAIVE_ACQUIRE.name].encode()
    orphaned = 0
    for i in range(FAULTS):
        key, fence_key = f"{prefix}lock:{{{i}}}", f"{prefix}fence:{{{i}}}"
        proxy.arm(name)
        reply = redis_scripts.call(client, NAIVE_ACQUIRE, [key, fence_key], ["t" * 32, 30000])
        if reply is None and redis_client.exists(key):
            orphaned += 1  # refused, and the lock stays set by nobody until its TTL
        redis_client.delete(key, fence_key)
    assert proxy.dropped == FAULTS
    assert orphaned == FAULTS
