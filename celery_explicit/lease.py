"""The visibility timeout belongs to the task: a lease on its message, kept while alive.

Celery's Redis transport has one global visibility timeout (celery#9349): a message
unacknowledged for longer is handed to another worker, so an ``acks_late`` task longer
than it runs twice (celery#5935), while a dead worker's message waits the whole global
timeout (default 1 h) before anyone runs it.

kombu keeps each unacknowledged message in the sorted set ``unacked_index``, scored by
delivery time; its periodic sweep (``restore_visible``) puts back every entry scored
below ``now - visibility_timeout``. Scoring an entry ``now + T - visibility_timeout``
therefore makes that message visible again ``T`` seconds from now. The worker's main
process does that every ``T / 4`` for each message it holds, with ``T`` the task's own
``visibility_timeout``:

- while the handler is alive the deadline keeps moving: a long but healthy task is
  never redelivered, however long it runs;
- when the worker dies the deadline stops moving: the job is visible again after ``T``
  plus one sweep (``unacked_restore_interval``), not after the global timeout;
- a message has its lease from the moment it is delivered: the write that records it
  as unacknowledged already scores it ``now + T - visibility_timeout``
  (``lease_on_delivery``), so a worker killed at any moment after the delivery leaves
  its job to ``T``, never to the global timeout. (Scored with its delivery time until
  the keeper's first look, up to 0.1 s later, 2 of 8 whole-worker kills in a kill storm
  left their job to the global timeout: issue 12, tests/fault/test_lease_window.py.)
  The lease record an operator reads is written at that first look
  (``FIRST_LEASE_INTERVAL``), which also leases any message the delivery did not (a
  task this worker does not know);
- a pool child that is stopped (SIGSTOP, ``T`` state in /proc) is not extended: its
  lease runs out like a dead worker's.

Each extension is one ``ZADD XX`` (the entry must still exist: an acked message is not
resurrected) plus the lease record an operator reads: ``{prefix}lease:{task_id}``, a
hash with owner (host:pid), deadline, extensions and the delivery tag, expiring with
the lease. All the messages of one heartbeat (or of one first-lease look) go in one
pipeline: one round trip, however many messages the worker holds. The global
``visibility_timeout`` stays as the backstop and must be longer than every task's
lease (``manage.py check``: django_outbox.E003).

The visibility part is for the Redis broker only; on RabbitMQ the broker redelivers on
connection loss, not on time. On every broker the same heartbeat extends each running
handler's execution lease (``celery_explicit.execution_lease``), which keeps a second
delivery of a job from running while the first is alive.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MethodType
from typing import Any

from celery import bootsteps

from celery_explicit import execution_lease, job_log, metrics, ordering, redis_state
from celery_explicit.conf import settings
from celery_explicit.contract import Contract
from celery_explicit.redis_scripts import Script, call_many
from celery_explicit.redis_state import text

logger = job_log.get_logger("celery_explicit.lease")

#: Extend every lease at this fraction of its timeout.
HEARTBEAT_FRACTION = 0.25
#: Seconds between looks for messages received since the last heartbeat: each gets its
#: lease record then (its lease it got on delivery, ``lease_on_delivery``). Cheap: a
#: look with nothing new sends nothing.
FIRST_LEASE_INTERVAL = 0.1

# KEYS[1] - kombu's unacked_index sorted set
# KEYS[2] - the lease record (hash)
# ARGV[1] - delivery tag
# ARGV[2] - new score: deadline - global visibility timeout (seconds, float)
# ARGV[3] - lease length in milliseconds (the record's TTL)
# ARGV[4] - owner (host:pid of the pool child, or of the worker before it starts)
# ARGV[5] - deadline in milliseconds since the epoch
# return 1 if the message is still unacknowledged and its lease was moved, otherwise 0
# (the record is deleted only if it is this delivery's: a retry or a deferral of the
# same job is a newer delivery with the same task id, and keeps its own)
EXTEND = Script(
    "message_lease_extend",
    """
if not redis.call('zscore', KEYS[1], ARGV[1]) then
    if redis.call('hget', KEYS[2], 'tag') == ARGV[1] then
        redis.call('del', KEYS[2])
    end
    return 0
end
redis.call('zadd', KEYS[1], 'XX', ARGV[2], ARGV[1])
redis.call('hset', KEYS[2], 'owner', ARGV[4], 'deadline_ms', ARGV[5], 'tag', ARGV[1])
redis.call('hincrby', KEYS[2], 'extensions', 1)
redis.call('pexpire', KEYS[2], ARGV[3])
return 1
""",
)


def record_key(task_id: str, *, prefix: str | None = None) -> str:
    """The message lease's record (owner, deadline, extensions) an operator reads."""
    return f"{prefix or redis_state.prefix()}lease:{task_id}"


def unacked_index_key(channel: Any) -> str:
    """kombu's ``unacked_index`` of ``channel``, as the server names it.

    kombu's own client adds the transport's ``global_keyprefix`` to the first key of an
    ``EVALSHA`` and to no key of an ``FCALL`` (``GlobalKeyPrefixMixin.
    PREFIXED_COMPLEX_COMMANDS`` in kombu/transport/redis.py,
    https://github.com/celery/kombu/blob/v5.5.0/kombu/transport/redis.py). So the
    heartbeat talks through a plain client on the channel's connection pool and adds
    the prefix itself. ``tests/integration/test_lease_keeper.py`` (run with and without
    a global prefix) and ``test_upstream_seams.py`` fail if kombu moves the index,
    renames these attributes or changes how it scores the index.
    """
    return str(getattr(channel, "global_keyprefix", "") or "") + str(channel.unacked_index_key)


def child_is_stopped(pid: int | None) -> bool:
    """True when the pool child is stopped (SIGSTOP, a debugger): /proc state T or t."""
    if not pid:
        return False
    return execution_lease.process_state(pid) in (b"T", b"t")


def lease_on_delivery(qos: Any, leases: Mapping[str, float]) -> None:
    """Give each message of a task in ``leases`` (name: its ``visibility_timeout``) its
    lease in the very write that records it as delivered, on kombu Redis ``qos``.

    kombu's ``QoS.append`` records a delivered message in one MULTI: ``ZADD
    unacked_index {tag: time()}`` and ``HSET unacked`` (kombu/transport/redis.py,
    ``QoS.append``, called by ``Channel.basic_consume``'s callback right after BRPOP:
    https://github.com/celery/kombu/blob/v5.5.0/kombu/transport/redis.py). Scored with
    its delivery time, the message would depend on the global timeout until the
    keeper's first look. The replacement writes the same two entries in the same MULTI,
    the score already ``now + T - visibility_timeout``: no moment in which a dead
    worker leaves the job to the global timeout. Other messages keep kombu's method.

    Replaced on the consumer's QoS object, as Celery replaces its ``can_consume``
    (celery/worker/consumer/tasks.py). tests/integration/test_lease_on_delivery.py
    fails if kombu's own method comes to write anything else.
    """
    qos.explicit_leases = dict(leases)
    qos.append = MethodType(_append_with_lease, qos)


def _append_with_lease(qos: Any, message: Any, delivery_tag: str) -> None:
    """``QoS.append`` of a consumer with ``lease_on_delivery``."""
    from kombu.transport import redis as kombu_redis
    from kombu.utils.json import dumps

    # Protocol 2 names the task in a header; a message without one keeps kombu's score
    # and gets its lease at the keeper's first look. The headers are the sender's: a
    # ``task`` that is not a str (a list is unhashable) or headers that are not a dict
    # are looked up no further, and the message goes through kombu's own method
    # unchanged (Celery then refuses it as a task).
    headers = message.headers
    name = headers.get("task") if isinstance(headers, dict) else None
    lease = qos.explicit_leases.get(name) if isinstance(name, str) else None
    if lease is None:
        type(qos).append(qos, message, delivery_tag)
        return
    delivery = message.delivery_info
    score = time.time() + lease - float(qos.visibility_timeout)
    raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
    with qos.pipe_or_acquire() as pipe:
        pipe.zadd(qos.unacked_index_key, {delivery_tag: score})
        pipe.hset(qos.unacked_key, delivery_tag, raw)
        pipe.execute()
    # What kombu's method does next: the in-memory record of the delivery.
    super(kombu_redis.QoS, qos).append(message, delivery_tag)


def contract_of(task: Any) -> Contract | None:
    """The contract of an ExplicitTask (None for any other task): read from the task,
    not by importing the task class, which sits above this module."""
    contract = getattr(task, "contract", None)
    return contract if isinstance(contract, Contract) else None


def held_requests() -> list[Any]:
    """Every request whose message this worker holds unacknowledged.

    The reserved ones (running, or waiting for a pool slot) and the scheduled ones (an
    ETA or a countdown: a retry, a deferral), which wait in the worker's memory until
    their time and whose message must come back as soon if the worker dies.
    """
    from celery.worker import state

    held = list(state.reserved_requests)
    seen = {id(request) for request in held}
    # Celery 5.7 lists them in a WeakSet of their own (celery/worker/state.py,
    # ``scheduled_requests``: https://github.com/celery/celery/blob/main/celery/worker/
    # state.py); before 5.7 it has none and they go unleased until they start.
    # tests/integration/test_upstream_seams.py fails if it goes away.
    scheduled = list(getattr(state, "scheduled_requests", ()))
    held += [r for r in scheduled if id(r) not in seen]
    return held


class LeaseKeeper(bootsteps.StartStopStep):
    """Consumer step: moves each held ExplicitTask message's deadline forward."""

    label = "celery_explicit: per-task visibility leases"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._tref: Any = None
        self._first_tref: Any = None
        self._redis_broker = False
        self._host = socket.gethostname()
        #: Delivery tags whose message has its lease, and those found already gone
        #: (acked between the listing and the lease): neither is leased anew by the
        #: first-lease look. Both are pruned to the messages still held at each
        #: heartbeat.
        self._leased: set[str] = set()
        self._gone: set[str] = set()
        self._client: Any = None

    def start(self, parent: Any) -> None:
        leases = [
            contract.visibility_timeout
            for contract in map(contract_of, parent.app.tasks.values())
            if contract is not None
        ]
        if not leases:
            return
        interval = max(0.2, min(10.0, min(leases) * HEARTBEAT_FRACTION))
        if getattr(parent.connection.transport, "driver_type", "") == "redis":
            self._redis_broker = True
            lease_on_delivery(
                parent.task_consumer.channel.qos,
                {
                    name: contract.visibility_timeout
                    for name, task in parent.app.tasks.items()
                    if (contract := contract_of(task)) is not None
                },
            )
            self._first_tref = parent.timer.call_repeatedly(
                FIRST_LEASE_INTERVAL, self.first_leases, (parent,)
            )
        self._tref = parent.timer.call_repeatedly(interval, self.tick, (parent,))

    def stop(self, parent: Any) -> None:
        for tref in (self._tref, self._first_tref):
            if tref is not None:
                tref.cancel()
        self._tref = self._first_tref = None

    def tick(self, parent: Any) -> None:
        """The heartbeat: every held message's lease, and every execution lease."""
        held = held_requests()
        self._extend_execution_leases(held)
        if not self._redis_broker:
            return  # the broker has no visibility timeout
        tags = {request.message.delivery_tag for request in held}
        self._leased &= tags
        self._gone &= tags
        self._lease_messages(parent, held)

    def first_leases(self, parent: Any) -> None:
        """Between heartbeats: a first lease for each message received since the last."""
        new = [
            request
            for request in held_requests()
            if contract_of(request.task) is not None
            and request.message.delivery_tag not in self._leased
            and request.message.delivery_tag not in self._gone
        ]
        if new:
            self._lease_messages(parent, new)

    def _lease_messages(self, parent: Any, held: list[Any]) -> None:
        import redis

        channel = parent.connection.default_channel
        try:
            self._extend_all(channel, self._broker_client(channel), held)
        except channel.connection_errors:
            logger.warning("could not extend leases: broker connection lost")
        except redis.RedisError as exc:
            # Out of memory, read-only after a failover: the leases run out unless a
            # later look or heartbeat succeeds. Never an error out of the consumer's timer.
            logger.warning("could not extend leases: %s", exc)

    def _extend_execution_leases(self, held: list[Any]) -> None:
        """Extend the execution lease of each live, running handler, and its entity's
        turn where it holds one (any broker): one pipeline for all of them."""
        import redis

        if not settings.lease_extend:
            return
        leases, turns = [], []
        for request in held:
            pid = request.worker_pid
            contract = contract_of(request.task)
            if contract is None or not pid:
                continue  # not started in a pool child yet: it holds no lease
            if child_is_stopped(pid):
                continue  # counted by the visibility lease below (Redis) or not at all
            owner = f"{self._host}:{pid}"
            leases.append((request.id, owner, contract.visibility_timeout))
            place = ordering.place_in(request.request_dict) if contract.ordering else None
            if place is not None:
                turns.append((place[0], request.id, contract.visibility_timeout))
        calls = ordering.alive_extensions(turns)
        if execution_lease.enabled():
            calls += execution_lease.extensions(leases)
        if not calls:
            return
        try:
            call_many(redis_state.client(), calls)
        except redis.RedisError:
            logger.warning("could not extend execution leases: Redis unavailable")

    def _broker_client(self, channel: Any) -> Any:
        """A plain redis-py client on the channel's own connection pool, kept while the
        pool lives: a pooled connection, never channel.client's own (that one may be
        blocked in BRPOP, and a reply read by the wrong reader stops the worker), and
        no kombu key prefixing (``unacked_index_key``)."""
        import redis

        pool = channel.pool
        if self._client is None or self._client.connection_pool is not pool:
            self._client = redis.Redis(connection_pool=pool)
        return self._client

    def _extend_all(self, channel: Any, client: Any, held: list[Any]) -> None:
        """Move the lease of each message in ``held``: one round trip for all of them."""
        backstop = float(channel.visibility_timeout)
        now = time.time()
        extend = settings.lease_extend
        index = unacked_index_key(channel)
        calls: list[tuple[Any, str, list[Any], list[Any]]] = []
        for request in held:
            task = request.task
            contract = contract_of(task)
            if contract is None:
                continue
            # Keyed by delivery: a deferral or a retry is a new message with the same
            # task id, and must get its own lease.
            tag = request.message.delivery_tag
            if not extend and tag in self._leased:
                continue  # switched off: each message gets its lease once, never more
            pid = request.worker_pid
            if child_is_stopped(pid):
                metrics.lease_not_extended.labels(task.name, "child_stopped").inc()
                if tag in self._leased:
                    continue
                # Stopped before its first heartbeat: its message still has kombu's
                # score (its delivery time), so it would wait out the global timeout.
                # Give it its own lease once; it runs out T from now.
            lease = contract.visibility_timeout
            deadline = now + lease
            keys = [index, record_key(request.id)]
            args = [
                tag,
                deadline - backstop,
                int(lease * 1000),
                f"{self._host}:{pid or os.getpid()}",
                int(deadline * 1000),
            ]
            calls.append((task, tag, keys, args))
        if not calls:
            return
        replies = call_many(client, [(EXTEND, keys, args) for _t, _tag, keys, args in calls])
        for (task, tag, _keys, _args), moved in zip(calls, replies, strict=True):
            if moved:
                self._leased.add(tag)
                metrics.lease_extensions.labels(task.name).inc()
            else:
                self._gone.add(tag)


@dataclass(frozen=True)
class LiveLease:
    """A held message's lease as an operator sees it (``manage.py explicit_leases``)."""

    task_id: str
    owner: str
    extensions: int
    expires_in: float  # seconds until the message is visible to other workers again
    delivery_tag: str


def live_leases(client: Any, *, prefix: str | None = None) -> list[LiveLease]:
    """Every lease record in the broker's Redis (SCAN, not KEYS)."""
    found = []
    prefix = prefix or redis_state.prefix()
    for raw_key in client.scan_iter(match=f"{prefix}lease:*", count=500, _type="HASH"):
        key = text(raw_key)
        info = {text(k): text(v) for k, v in client.hgetall(key).items()}
        # The clock is read after the record: a heartbeat landing between a clock read
        # first and the record would show more time left than the lease's length.
        now_ms = time.time() * 1000
        if not info:
            continue  # acked or expired between SCAN and now
        found.append(
            LiveLease(
                task_id=key[len(f"{prefix}lease:") :],
                owner=info.get("owner", ""),
                extensions=int(info.get("extensions", 0)),
                expires_in=max(0.0, (int(info.get("deadline_ms", now_ms)) - now_ms) / 1000.0),
                delivery_tag=info.get("tag", ""),
            )
        )
    return sorted(found, key=lambda lease: lease.expires_in)
