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
  left their job to the global timeout: tests/fault/test_lease_window.py.)
  The lease record an operator reads is written at that first look
  (``FIRST_LEASE_INTERVAL``), which also leases any message the delivery did not (a
  task this worker does not know);
- a pool child that is stopped (SIGSTOP, ``T`` state in /proc) is not extended: its
  lease runs out like a dead worker's;
- during a warm shutdown (a deploy's SIGTERM) Celery stops the consumer, and this
  heartbeat with it, before the pool has drained: a thread of the main process then
  keeps extending what still runs and gives back at once what never started
  (``LeaseKeeper._start_drain``);
- every time is the Redis server's (``TIME`` inside the scripts that write a score,
  and in the sweep that compares them, ``sweep_by_server_clock``): the host that
  leases a message and the one that sweeps may disagree on the time by more than a
  lease, the server cannot disagree with itself;
- a message a sweep restored keeps its delivery tag, and kombu acks by tag: beside
  ``unacked`` a hash names the worker that holds each delivery now, and the ack,
  requeue and shutdown restore of any other worker (a stale copy) leave its record
  alone (``_ack_if_held``).

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
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MethodType
from typing import Any

from celery import bootsteps

from celery_explicit import atomic_fetch, execution_lease, job_log, metrics, ordering, redis_state
from celery_explicit.conf import settings
from celery_explicit.contract import Contract
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, call, call_many, server_time
from celery_explicit.redis_state import text

logger = job_log.get_logger("celery_explicit.message_lease")

#: Extend every lease at this fraction of its timeout.
HEARTBEAT_FRACTION = 0.25
#: Seconds between looks for messages received since the last heartbeat: each gets its
#: lease record then (its lease it got on delivery, ``lease_on_delivery``). Cheap: a
#: look with nothing new sends nothing.
FIRST_LEASE_INTERVAL = 0.1

# KEYS[1] - kombu's unacked_index sorted set
# KEYS[2] - the lease record (hash)
# KEYS[3] - the delivery holders (hash: delivery tag -> the worker holding it)
# ARGV[1] - delivery tag
# ARGV[2] - lease length in milliseconds (the record's TTL)
# ARGV[3] - the global visibility timeout in milliseconds (the backstop)
# ARGV[4] - owner (host:pid of the pool child, or of the worker before it starts)
# ARGV[5] - this worker's holder id (``holder_id()``)
# The deadline is the server's clock plus the lease, and the score that deadline less
# the backstop: the sweep that compares it (``_restore_visible``) reads the same clock.
# return 1 if the message is still unacknowledged, held by this worker, and its lease
# was moved, otherwise 0 (the record is deleted only if it is this delivery's: a retry
# or a deferral of the same job is a newer delivery with the same task id, and keeps
# its own; a delivery another worker took over keeps its lease and its record)
EXTEND = Script(
    "message_lease_extend_held",
    SERVER_NOW_MS
    + """
if not redis.call('zscore', KEYS[1], ARGV[1]) then
    if redis.call('hget', KEYS[2], 'tag') == ARGV[1] then
        redis.call('del', KEYS[2])
    end
    return 0
end
local holder = redis.call('hget', KEYS[3], ARGV[1])
if holder and holder ~= ARGV[5] then
    return 0
end
local deadline_ms = now_ms + tonumber(ARGV[2])
redis.call('zadd', KEYS[1], 'XX', (deadline_ms - tonumber(ARGV[3])) / 1000, ARGV[1])
redis.call('hset', KEYS[2], 'owner', ARGV[4], 'deadline_ms', string.format('%.0f', deadline_ms),
    'tag', ARGV[1])
redis.call('hincrby', KEYS[2], 'extensions', 1)
redis.call('pexpire', KEYS[2], ARGV[2])
return 1
""",
)

# KEYS[1] - kombu's unacked_index   KEYS[2] - kombu's unacked hash
# KEYS[3] - the delivery holders
# ARGV[1] - delivery tag            ARGV[2] - the message as kombu records it
# ARGV[3] - its lease in ms
# ARGV[4] - the global visibility timeout in ms   ARGV[5] - holder id, or "" for none
# return 1. kombu's ``QoS.append`` writes the same two entries in one MULTI, scored
# with the worker's clock; here the score is the server's, as every sweep reads it.
ON_DELIVERY = Script(
    "message_lease_on_delivery",
    SERVER_NOW_MS
    + """
redis.call('zadd', KEYS[1], (now_ms + tonumber(ARGV[3]) - tonumber(ARGV[4])) / 1000, ARGV[1])
redis.call('hset', KEYS[2], ARGV[1], ARGV[2])
if ARGV[5] ~= '' then
    redis.call('hset', KEYS[3], ARGV[1], ARGV[5])
end
return 1
""",
)

# KEYS[1] - kombu's unacked_index   KEYS[2] - kombu's unacked hash
# KEYS[3] - the delivery holders
# ARGV[1] - delivery tag            ARGV[2] - this worker's holder id
# return 1 if the delivery's record was removed (this worker held it, or no holder
# was recorded), 0 if another worker holds that delivery now (nothing touched)
ACK = Script(
    "message_ack_if_held",
    """
local holder = redis.call('hget', KEYS[3], ARGV[1])
if holder and holder ~= ARGV[2] then
    return 0
end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('hdel', KEYS[2], ARGV[1])
redis.call('hdel', KEYS[3], ARGV[1])
return 1
""",
)

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

_holder_id = ""


def holder_id() -> str:
    """This worker process's name in the delivery holders: host:pid and a random part
    (a pid is reused; a restarted worker must not pass for the one before it)."""
    global _holder_id
    me = f"{socket.gethostname()}:{os.getpid()}:"
    if not _holder_id.startswith(me):  # computed again in a forked process
        _holder_id = me + uuid.uuid4().hex[:8]
    return _holder_id


def holders_key(unacked_key: str) -> str:
    """The hash beside kombu's ``unacked`` naming which worker holds each delivery."""
    return f"{unacked_key}_holder"


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


def holders_key_of(channel: Any) -> str:
    """Our delivery holders beside kombu's ``unacked`` of ``channel``, as the server
    names them (the transport's ``global_keyprefix`` added, as ``unacked_index_key``)."""
    return str(getattr(channel, "global_keyprefix", "") or "") + holders_key(
        str(channel.unacked_key)
    )


def broker_client(channel: Any) -> Any:
    """A plain redis-py client on the channel's own connection pool, kept while the
    pool lives: a pooled connection, never channel.client's own (that one may be
    blocked in BRPOP, and a reply read by the wrong reader stops the worker), and no
    kombu key prefixing (``unacked_index_key``: kombu would prefix only the first key
    of a script call)."""
    import redis

    pool = channel.pool
    client = getattr(channel, "explicit_client", None)
    if client is None or client.connection_pool is not pool:
        client = channel.explicit_client = redis.Redis(connection_pool=pool)
    return client


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
    # Off: no holder is recorded (nothing would remove it) and kombu's ack stays.
    qos.explicit_holder = holder_id() if settings.delivery_holder else ""
    qos.append = MethodType(_append_with_lease, qos)
    channel = qos.channel
    atomic_fetch.install(
        channel,
        client=broker_client(channel),
        leases=qos.explicit_leases,
        backstop=float(qos.visibility_timeout),
        holder=qos.explicit_holder,
        index_key=unacked_index_key(channel),
        unacked_key=str(getattr(channel, "global_keyprefix", "") or "") + str(qos.unacked_key),
        holders_key=holders_key_of(channel),
    )
    if qos.explicit_holder:
        qos.ack = MethodType(_ack_if_held, qos)
        qos.reject = MethodType(_reject_if_held, qos)
        qos.restore_unacked = MethodType(_restore_unacked_if_held, qos)


def _append_with_lease(qos: Any, message: Any, delivery_tag: str) -> None:
    """``QoS.append`` of a consumer with ``lease_on_delivery``."""
    from kombu.transport import redis as kombu_redis
    from kombu.utils.json import dumps

    if atomic_fetch.recorded_by_fetch(qos.channel):
        # Recorded, lease and holder with it, by the script that took the message off
        # its queue: what is left is kombu's in-memory record of the delivery.
        super(kombu_redis.QoS, qos).append(message, delivery_tag)
        return
    # Protocol 2 names the task in a header; a message without one keeps kombu's score
    # and gets its lease at the keeper's first look. The headers are the sender's: a
    # ``task`` that is not a str (a list is unhashable) or headers that are not a dict
    # are looked up no further, and the message goes through kombu's own method
    # unchanged (Celery then refuses it as a task).
    headers = message.headers
    name = headers.get("task") if isinstance(headers, dict) else None
    lease = qos.explicit_leases.get(name) if isinstance(name, str) else None
    if lease is None:
        # Not an ExplicitTask's: kombu's own score (this host's clock), outside our
        # promise, which the server-clock sweep then compares with the server's.
        type(qos).append(qos, message, delivery_tag)
        return
    backstop = float(qos.visibility_timeout)
    delivery = message.delivery_info
    raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
    channel = qos.channel
    unacked = str(getattr(channel, "global_keyprefix", "") or "") + str(qos.unacked_key)
    # The holder: which worker holds this delivery now. A copy restored by a sweep keeps
    # its tag, so the tag alone cannot tell the live copy from a stale one.
    call(
        broker_client(channel),
        ON_DELIVERY,
        [unacked_index_key(channel), unacked, holders_key_of(channel)],
        [
            delivery_tag,
            raw,
            int(lease * 1000),
            int(backstop * 1000),
            qos.explicit_holder,
        ],
    )
    # What kombu's method does next: the in-memory record of the delivery.
    super(kombu_redis.QoS, qos).append(message, delivery_tag)


_kombu_restore_visible: Any = None


def sweep_by_server_clock() -> None:
    """Make kombu's sweep (``QoS.restore_visible``) of every channel in this worker
    compare the scores with the Redis server's clock.

    kombu's sweep puts back every message scored below ``time() - visibility_timeout``
    with the sweeping host's clock, and the scores were written by other hosts: a
    sweeper whose clock runs ahead by more than a lease restores live jobs, one behind
    leaves dead workers' jobs waiting. Replaced on the class at ``worker_init``, not on
    the consumer's channel when its step starts: kombu sweeps once through whichever
    channel comes first as the consumer connects, before any consumer step runs (seen:
    a worker 40 s ahead took a live job at start). ``EXPLICIT_SERVER_CLOCK=0`` calls
    kombu's own.
    """
    from kombu.transport import redis as kombu_redis

    global _kombu_restore_visible
    if _kombu_restore_visible is None:
        _kombu_restore_visible = kombu_redis.QoS.restore_visible
        kombu_redis.QoS.restore_visible = _restore_visible  # type: ignore[method-assign,assignment]


def on_worker_init(sender: Any = None, **_: Any) -> None:
    """``worker_init``: the sweep reads the server's clock from the worker's first one
    (kombu sweeps as the consumer connects, before any consumer step starts)."""
    sweep_by_server_clock()


def _restore_visible(qos: Any, start: int = 0, num: int = 10, interval: int = 10) -> None:
    """``QoS.restore_visible`` with the server's clock: the same throttle (a scan every
    ``interval`` calls), the same mutex, the same restore by tag."""
    from kombu.transport.redis import Mutex, MutexHeld

    if not settings.server_clock:
        _kombu_restore_visible(qos, start, num, interval)
        return
    qos._vrestore_count += 1
    if (qos._vrestore_count - 1) % (interval or 1):
        return
    with qos.channel.conn_or_acquire() as client:
        ceiling = server_time(client) - float(qos.visibility_timeout)
        page = {"offset": start, "num": num} if num else {}
        try:
            with Mutex(client, qos.unacked_mutex_key, qos.unacked_mutex_expire):
                due = client.zrange(
                    qos.unacked_index_key, ceiling, 0, desc=True, byscore=True, **page
                )
                for tag in due or []:
                    qos.restore_by_tag(tag, client)
        except MutexHeld:
            pass


def _held_elsewhere(qos: Any, delivery_tag: str) -> bool:
    """True when another worker holds ``delivery_tag`` now (this copy is stale)."""
    holder = broker_client(qos.channel).hget(holders_key_of(qos.channel), delivery_tag)
    return holder is not None and text(holder) != qos.explicit_holder


def _ack_if_held(qos: Any, delivery_tag: str) -> None:
    """``QoS.ack`` of a consumer with ``lease_on_delivery``: removes the broker's
    record of the delivery only while this worker holds it.

    kombu removes by tag (``ZREM unacked_index``, ``HDEL unacked``), and a message a
    sweep restored keeps its tag. A stale copy (its process stopped past its lease,
    the job taken over elsewhere) that is acked when it wakes up would remove the
    record of the copy another worker is running: if that worker then died, nothing
    would restore the job. One script, one round trip, as kombu's own pipeline.
    """
    from kombu.transport import redis as kombu_redis

    channel = qos.channel
    unacked = str(getattr(channel, "global_keyprefix", "") or "") + str(qos.unacked_key)
    keys = [unacked_index_key(channel), unacked, holders_key_of(channel)]
    removed = call(broker_client(channel), ACK, keys, [delivery_tag, qos.explicit_holder])
    if not removed:
        metrics.stale_acks_withheld.labels("ack").inc()
        logger.warning(
            "ack of delivery %s left to the worker that holds it now (this copy is stale)",
            delivery_tag,
        )
    super(kombu_redis.QoS, qos).ack(delivery_tag)


def _reject_if_held(qos: Any, delivery_tag: str, requeue: bool = False) -> None:
    """``QoS.reject``: a requeue puts the message back only while this worker holds
    it (a stale copy's requeue would add a second copy and drop the live one's
    record); a reject without requeue removes the record as ``_ack_if_held`` does."""
    from kombu.transport import redis as kombu_redis

    if not requeue:
        _ack_if_held(qos, delivery_tag)
        return
    if _held_elsewhere(qos, delivery_tag):
        metrics.stale_acks_withheld.labels("requeue").inc()
        logger.warning("requeue of delivery %s left to the worker that holds it now", delivery_tag)
    else:
        qos.restore_by_tag(delivery_tag, leftmost=True)
    super(kombu_redis.QoS, qos).ack(delivery_tag)


def _restore_unacked_if_held(qos: Any, client: Any = None) -> None:
    """``QoS.restore_unacked`` (the channel's close): each message this worker still
    holds goes back to its queue; one another worker took over is left to it."""
    with qos.channel.conn_or_acquire(client) as conn:
        for tag in list(qos._delivered):
            if _held_elsewhere(qos, tag):
                metrics.stale_acks_withheld.labels("restore").inc()
                continue
            qos.restore_by_tag(tag, client=conn)
    qos._delivered.clear()


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
        self._interval: float | None = None
        self._drain_stop: threading.Event | None = None
        #: What the drain's own Redis client needs, read while the consumer is
        #: connected: a consumer restarting after a lost connection stops this step
        #: with its connection already gone (``parent.connection`` is None).
        self._drain_target: tuple[Any, Any, dict[str, Any], float, str, str] | None = None

    def start(self, parent: Any) -> None:
        self._stop_drain()  # the consumer is back: its timer keeps the leases again
        leases = [
            contract.visibility_timeout
            for contract in map(contract_of, parent.app.tasks.values())
            if contract is not None
        ]
        if not leases:
            return
        interval = self._interval = max(0.2, min(10.0, min(leases) * HEARTBEAT_FRACTION))
        if getattr(parent.connection.transport, "driver_type", "") == "redis":
            self._redis_broker = True
            channel = parent.connection.default_channel
            pool = channel.pool
            self._drain_target = (
                type(pool),
                pool.connection_class,
                dict(pool.connection_kwargs),
                float(channel.visibility_timeout),
                unacked_index_key(channel),
                holders_key_of(channel),
            )
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
        self._start_drain(parent)

    def _start_drain(self, parent: Any) -> None:
        """Keep the leases of the jobs still running while the pool drains.

        Celery stops the consumer's steps, and the timer that runs this step's
        heartbeat, before its pool has finished the jobs it runs (a warm shutdown: the
        Consumer step stops before the Pool step joins; a consumer restart after a lost
        connection too). Without a heartbeat, a job longer than its lease would be
        started a second time elsewhere during every deploy. A thread of the main
        process takes over until the jobs end, the consumer starts again, or the
        process exits; its own Redis connections, never the consumer's.
        """
        if self._interval is None or not settings.drain_heartbeat:
            return
        self._stop_drain()
        stop = self._drain_stop = threading.Event()
        broker = None
        if self._redis_broker and self._drain_target is not None:
            import redis

            pool_class, connection_class, connection_kwargs, backstop, index, holders = (
                self._drain_target
            )
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
            target=self._drain,
            args=(stop, broker, self._interval),
            name="celery_explicit-drain-heartbeat",
            daemon=True,
        )
        thread.start()

    def _stop_drain(self) -> None:
        if self._drain_stop is not None:
            self._drain_stop.set()
            self._drain_stop = None

    def _drain(self, stop: threading.Event, broker: _DrainBroker | None, interval: float) -> None:
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
            self._extend_all(channel, broker_client(channel), held)
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

    def _extend_all(self, channel: Any, client: Any, held: list[Any]) -> None:
        """Move the lease of each message in ``held``: one round trip for all of them."""
        backstop = float(channel.visibility_timeout)
        extend = settings.lease_extend
        index, holders, me = unacked_index_key(channel), holders_key_of(channel), holder_id()
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
            keys, args = extend_arguments(
                request, contract, index, holders, backstop, self._host, me
            )
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


def extend_arguments(
    request: Any,
    contract: Contract,
    index: str,
    holders: str,
    backstop: float,
    host: str,
    me: str,
) -> tuple[list[Any], list[Any]]:
    """``EXTEND``'s keys and arguments for ``request``'s message: its deadline the
    server's now plus the task's lease, scored against the broker's ``backstop``."""
    keys = [index, record_key(request.id), holders]
    args = [
        request.message.delivery_tag,
        int(contract.visibility_timeout * 1000),
        int(backstop * 1000),
        f"{host}:{request.worker_pid or os.getpid()}",
        me,
    ]
    return keys, args


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
        # first and the record would show more time left than the lease's length. The
        # server's clock: the deadline was written in it.
        now_ms = server_time(client) * 1000
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
