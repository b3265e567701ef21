"""The message lease through a warm shutdown: a heartbeat while the pool drains.

Celery stops the consumer's steps, and the timer that runs the keeper's heartbeat
(``celery_explicit.message_lease_keeper``), before its pool has finished the jobs it
runs (a warm shutdown: the Consumer step stops before the Pool step joins; a consumer
restart after a lost connection too). Without a heartbeat, a job longer than its lease
would be started a second time elsewhere during every deploy.

So when the keeper stops, a thread of the main process takes over until the jobs end,
the consumer starts again, or the process exits. At each heartbeat it extends the
leases of the jobs a pool process runs (their execution leases on any broker, their
messages' on Redis), and gives back at once each message no pool process started: the
pool of a worker in warm shutdown never starts it, and the next sweep of any worker
puts it back in its queue. It reaches the broker's Redis through a pool of its own,
built from what the keeper read while the consumer was connected: the consumer's
connections may be closing, or gone. ``EXPLICIT_DRAIN_HEARTBEAT=0`` turns it off
(the negative control of ``tests/fault/test_deploys.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_explicit import job_log, metrics
from celery_explicit.conf import settings
from celery_explicit.message_lease import (
    EXTEND,
    child_is_stopped,
    contract_of,
    extend_arguments,
    held_requests,
    holder_id,
    holders_key_of,
    unacked_index_key,
)
from celery_explicit.redis_scripts import Script, call_many

logger = job_log.get_logger("celery_explicit.message_lease_drain")

# KEYS[1] - kombu's unacked_index   KEYS[2] - the delivery holders
# ARGV[1] - delivery tag            ARGV[2] - this worker's holder id
# return 1 if the message will be restored by the next sweep of any worker (its score
# set to 0, below every sweep's ceiling), 0 if it is gone or another worker holds it
GIVE_BACK = Script(
    "message_give_back",
    """
local holder = redis.call('hget', KEYS[2], ARGV[1])
if holder and holder ~= ARGV[2] then
    return 0
end
return redis.call('zadd', KEYS[1], 'XX', 'CH', 0, ARGV[1])
""",
)


class Drain:
    """The drain's heartbeat: started when the keeper stops, stopped when it starts.

    ``extend_execution_leases`` is the keeper's own (the same leases, the same owner
    names); ``host`` names this worker's pool processes in the records it writes.
    """

    def __init__(self, extend_execution_leases: Callable[[list[Any]], None], host: str) -> None:
        self._extend_execution_leases = extend_execution_leases
        self._host = host
        self._stop: threading.Event | None = None
        #: What the drain's own Redis client needs, read while the consumer is
        #: connected: a consumer restarting after a lost connection stops the keeper
        #: with its connection already gone (``parent.connection`` is None).
        self._target: tuple[Any, Any, dict[str, Any], float, str, str] | None = None

    def remember(self, channel: Any) -> None:
        """Read the broker's pool and keys off the consumer's Redis ``channel``."""
        pool = channel.pool
        self._target = (
            type(pool),
            pool.connection_class,
            dict(pool.connection_kwargs),
            float(channel.visibility_timeout),
            unacked_index_key(channel),
            holders_key_of(channel),
        )

    def start(self, interval: float | None) -> None:
        """Keep the leases of the jobs still running while the pool drains, every
        ``interval`` seconds (None: the worker has no ExplicitTask, nothing to keep);
        on the Redis broker only if ``remember`` was called; its own Redis connections,
        never the consumer's."""
        if interval is None or not settings.drain_heartbeat:
            return
        self.stop()
        stop = self._stop = threading.Event()
        broker = None
        if self._target is not None:
            import redis

            pool_class, connection_class, connection_kwargs, backstop, index, holders = self._target
            broker = _DrainBroker(
                client=redis.Redis(
                    connection_pool=pool_class(
                        connection_class=connection_class, **connection_kwargs
                    )
                ),
                backstop=backstop,
                index=index,
                holders=holders,
            )
        thread = threading.Thread(
            target=self._run,
            args=(stop, broker, interval),
            name="celery_explicit-drain-heartbeat",
            daemon=True,
        )
        thread.start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def _run(self, stop: threading.Event, broker: _DrainBroker | None, interval: float) -> None:
        """The drain's heartbeat (a thread): extend what runs, give back what never
        started, until nothing runs or the consumer is back."""
        import redis

        given_back: set[str] = set()
        while not stop.wait(interval):
            ours = [r for r in _held_now() if contract_of(r.task) is not None]
            running = [r for r in ours if r.worker_pid and not r.acknowledged]
            waiting = [
                r for r in ours if not r.worker_pid and r.message.delivery_tag not in given_back
            ]
            if not running and not waiting:
                return
            self._extend_execution_leases(running)
            if broker is None:
                continue
            try:
                if settings.lease_extend:  # switched off: the leases run out, as above
                    broker.extend(running, self._host)
                given_back |= broker.give_back(waiting)
            except redis.RedisError as exc:
                logger.warning("drain: could not extend or give back leases: %s", exc)


def _held_now() -> list[Any]:
    """``held_requests()`` from a thread: the main process may change the sets while
    they are copied (RuntimeError), so copy again."""
    for _ in range(10):
        try:
            return held_requests()
        except RuntimeError:
            time.sleep(0.01)
    return []


@dataclass(frozen=True)
class _DrainBroker:
    """The drain's own view of the broker's Redis: a client on a pool of its own (the
    consumer's may be closing), and the keys it writes."""

    client: Any
    backstop: float
    index: str
    holders: str

    def extend(self, running: list[Any], host: str) -> None:
        """Move the lease of each running job's message (one round trip)."""
        me = holder_id()
        calls = []
        for request in running:
            contract = contract_of(request.task)
            if contract is None or child_is_stopped(request.worker_pid):
                continue  # a stopped child's lease runs out, as in the heartbeat
            keys, args = extend_arguments(
                request, contract, self.index, self.holders, self.backstop, host, me
            )
            calls.append((EXTEND, keys, args))
        if calls:
            call_many(self.client, calls)

    def give_back(self, waiting: list[Any]) -> set[str]:
        """Make each message no pool process started visible at once: the next sweep
        of any worker puts it back in its queue (the pool of a worker in warm
        shutdown never starts it). The tags handled."""
        if not waiting:
            return set()
        me = holder_id()
        tags = [request.message.delivery_tag for request in waiting]
        calls = [(GIVE_BACK, [self.index, self.holders], [tag, me]) for tag in tags]
        for request, moved in zip(waiting, call_many(self.client, calls), strict=True):
            if moved:
                metrics.drain_releases.labels(request.task.name).inc()
                logger.info(
                    "warm shutdown: gave back job %s, which no pool process had started",
                    request.id,
                )
        return set(tags)
